"""The kit's server launcher: a refused start fails fast with the server's own words."""

from __future__ import annotations

import pytest

from tensorfold.testing.process import serving


def test_a_server_that_refuses_to_start_raises_with_its_log(tmp_path):
    log = tmp_path / "log"
    with pytest.raises(RuntimeError, match=r"(?s)exit 2.*--context 1 is too small"):
        with serving(["--family", "example", "--context", "1"], log, env={"XDG_CACHE_HOME": str(tmp_path)}):
            pass
