"""quick_device_calls: a helper called inside an interpreted launch reuses the language modules the launch patched
(counted), the results are the same bits as without it, and the launch still restores triton.language after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import json, sys
    import numpy as np
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter
    from tensorfold.testing import triton_interpreter

    original, calls = interpreter._patch_lang, []

    def counted(fn):
        calls.append(fn.__name__)
        return original(fn)

    interpreter._patch_lang = counted
    installed = triton_interpreter.quick_device_calls() if sys.argv[1] == "quick" else None

    @triton.jit
    def scaled(v, s):
        return v * s + 1.0

    @triton.jit
    def kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs)
        for i in tl.static_range(6):
            v = scaled(v, 0.5 + i)
        tl.store(y_ptr + offs, v + tl.sum(v, axis=0))

    x = torch.arange(32, dtype=torch.float32) / 7
    y = torch.empty_like(x)
    kernel[(4,)](x, y, BLOCK=8)
    first = len(calls)
    kernel[(4,)](x, y, BLOCK=8)
    print(json.dumps({"installed": installed, "again": triton_interpreter.quick_device_calls()
                      if installed else None, "first": first, "second": len(calls) - first,
                      "restored": hasattr(tl.program_id, "__triton_builtin__"), "y": y.tolist()}))
''')


def run(tmp_path: Path, mode: str) -> dict:
    script = tmp_path / "kernel.py"       # triton's interpreter reads a kernel's source from its file
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_launch_patches_the_language_once_and_the_bits_do_not_change(tmp_path):
    plain, quick = run(tmp_path, "plain"), run(tmp_path, "quick")
    assert quick["installed"] is True and quick["again"] is True
    assert quick["y"] == plain["y"]
    # per launch: the launch itself, then 4 programs each calling `scaled` 6 times and tl.sum (a jit function of
    # triton.language.standard, whose module also holds triton.language.core) once
    assert plain["first"] == plain["second"] == 1 + 4 * (6 + 1)
    assert quick["first"] == quick["second"] == 2          # the launch, then the first helper that brings in core
    assert plain["restored"] and quick["restored"]
