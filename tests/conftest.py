import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax.numpy as jnp
import pytest

from jaxspec.models import Llama, ModelConfig


@pytest.fixture(scope="session")
def smollm():
    from jaxspec.models.loading import load
    return load("smollm2-135m", jnp.float32)


TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position=512, eos_token_ids=(63,))


@pytest.fixture(scope="session")
def tiny():
    from flax import nnx
    return Llama(TINY, rngs=nnx.Rngs(3))
