"""GLM through real `tensorfold serve --family glm` processes on the embedded tiny checkpoint (no --model; NaN-
poisoned pages): chat and completions answer the real openai client; an image part is refused by name with a 400;
the reuse gate (tools/reuse_gate.py, every scenario) passes against a cache-on server with small device and host
tiers and a cache-off replay; and with --learn-conversations a state written at SIGTERM is read by a new server
process, whose next turn's token ids equal a fresh server's and resume at the first turn's history end
(tensorfold.testing.family_served runs each)."""

from __future__ import annotations

import pytest

from tensorfold.testing import family_served
from tensorfold.testing.family_served import ServedFamily
from tensorfold.testing.served import check_chat_and_completions

pytest.importorskip("openai")
pytestmark = pytest.mark.slow

# about 0.3 and 0.6 MiB: the eviction scenario pushes states device -> host -> out with a few fillers
GATE_CACHED = ["--prompt-cache-gib", "0.0003", "--host-cache-gib", "0.0006"]
GLM = ServedFamily("glm", cached=GATE_CACHED)

cache, base, tokenizer = family_served.fixtures(GLM)


def test_chat_and_completions_on_the_embedded_glm(base):
    assert check_chat_and_completions(base, "Hello, GLM").startswith("glm-")


def test_an_image_is_refused_by_name(base):
    family_served.check_image_refused(base)


def test_the_reuse_gate_passes(base, cache, tmp_path):
    family_served.check_reuse_gate(GLM, cache, tmp_path)


def test_a_state_written_at_sigterm_is_read_by_a_new_server_process(base, cache, tokenizer, tmp_path):
    family_served.check_learned_restart(GLM, cache, tokenizer, tmp_path)
