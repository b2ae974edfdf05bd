"""jaxspec: speculative decoding in JAX/Pallas."""

from jaxspec import compile_options  # noqa: F401  (XLA flags the GPU client must see as it starts)

__all__ = ["Generator", "SamplingParams", "Completion", "SpecConfig"]


def __getattr__(name):  # lazy, so `python -m jaxspec.train` etc. don't import the whole engine
    if name == "SamplingParams":
        from jaxspec.sampling import SamplingParams
        return SamplingParams
    if name in ("Generator", "Completion"):
        from jaxspec import generator
        return getattr(generator, name)
    if name == "SpecConfig":
        from jaxspec.speculative import SpecConfig
        return SpecConfig
    raise AttributeError(name)
