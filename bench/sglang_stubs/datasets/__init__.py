"""Stub of Hugging Face `datasets`: the load client's MMMU loader imports it at module level; random-ids never
calls it."""


def load_dataset(*args, **kwargs):
    raise RuntimeError("the `datasets` package is stubbed in bench/sglang_stubs: only random-ids is supported")
