"""jaxspec: speculative decoding in JAX/Pallas."""
import os as _os

# XLA's GPU dots as cuBLAS calls rather than Triton GEMM fusions, each of which XLA generates and
# compiles through Triton apiece (404 in one EAGLE-3 verify program of SmolLM2): that halved each
# program's compile on the H200 (bench/probes/compile_phases.py, compile_probe-NVIDIA-H200.json).
# Read when JAX starts its GPU backend; a setting of the flag in XLA_FLAGS wins, and
# JAXSPEC_TRITON_GEMM=1 keeps XLA's default.
if "xla_gpu_enable_triton_gemm" not in _os.environ.get("XLA_FLAGS", "") and _os.environ.get("JAXSPEC_TRITON_GEMM") != "1":
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()

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
