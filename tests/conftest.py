import multiprocessing
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compilation is most of the suite's time (the tests' tiny models run in microseconds). LLVM's
# optimisation passes are the bulk of a CPU compile: without them the mixed-requests test takes
# 47 s instead of 124 s. And many tests build the same step programs (same tiny model, same
# buckets) in fresh Generators: a persistent cache shared by the xdist workers compiles each once.
# Its keys are the programs' HLO, the flags and the jax version, so a stale entry cannot match.
# XLA's CPU fusion emitters (MLIR) took twice the compile time of its older LLVM IR emitters on the
# tiny models' programs: an EAGLE-3 verify_steps 3.4-3.8 s against 2.0-2.3, decode 1.0-1.1 against
# 0.5-0.6 (bench/results/cpu_compile-cpu.json). SmolLM2's tests got slower with the old ones
# (test_shipped.py 99 s -> 183, test_golden.py 34 -> 62), but the whole suite with an empty cache
# took 1304 s instead of 1569 (suite_durations-cold-before- and -cold-old-emitters-cpu.json). An XLA
# that does not know the flag aborts at start: it is asked first, in a subprocess.
FAST_FLAGS = ("--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
              "--xla_llvm_disable_expensive_passes=true")
OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flags: str) -> bool:
    import subprocess
    import sys
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                          timeout=300).returncode == 0


if "XLA_FLAGS" not in os.environ:  # xdist workers inherit the controller's choice
    os.environ["XLA_FLAGS"] = FAST_FLAGS + (" " + OLD_EMITTERS if _xla_knows(OLD_EMITTERS) else "")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxspec-test-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax.numpy as jnp
import pytest
from jax import stages

from jaxspec.programs import Programs

# Those flags trade the programs' speed for their compile time, which pays for the tiny models'
# programs only. SmolLM2's plain programs ran 2.6x slower under them (30 greedy tokens: 4.59 s
# against 1.75) and compiled about as fast, so a target-only program over more than
# BIG_PROGRAM_BYTES of weights compiles with XLA's full optimisation, asked for per compile
# (bench/results/cpu_compile-smollm2-cpu.json). The whole suite with an empty cache: 1196 s before,
# 888 s after in a fresh clone at 51b1c8b, whose server tests' engine process was also warmed up and
# optimised (suite_durations-cold-base-, -ci-cold-fresh-clone-cpu.json). A drafter's programs keep
# the fast flags: optimised, SmolLM2's EAGLE-3 engine took 24.2 s against 27.4 for its first
# generate, within the compiles' spread from run to run.
BIG_PROGRAM_BYTES = 64 << 20
FULL_OPTIMISATION = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}
if OLD_EMITTERS in os.environ["XLA_FLAGS"]:
    FULL_OPTIMISATION["xla_cpu_use_fusion_emitters"] = True
_OPTIMISED: set = set()  # id() of the lowered programs to compile so (Lowered has no attributes of its own)
_lower, _compile = Programs._lower, stages.Lowered.compile


def big(progs) -> bool:
    """Whether a Programs' weights are over BIG_PROGRAM_BYTES."""
    return sum(x.nbytes for x in progs.state) > BIG_PROGRAM_BYTES


def compiles_optimised(progs) -> bool:
    """Whether a Programs' programs compile with FULL_OPTIMISATION: target-only and big."""
    return progs._target_leaves == len(progs.state) and big(progs)


def _lower_marking_big_programs(self, name, flags, cache, args):
    lowered = _lower(self, name, flags, cache, args)
    if compiles_optimised(self):
        _OPTIMISED.add(id(lowered))
    return lowered


def _compile_marked_optimised(self, compiler_options=None, **kw):
    if id(self) in _OPTIMISED:
        _OPTIMISED.discard(id(self))
        compiler_options = {**FULL_OPTIMISATION, **(compiler_options or {})}
    return _compile(self, compiler_options, **kw)


# Not in a test's engine process (server.py's set-up, spawned): with its programs optimised, the
# fault run there turned away nearly every request in some suite runs (cause not found yet).
if multiprocessing.parent_process() is None:
    Programs._lower, stages.Lowered.compile = _lower_marking_big_programs, _compile_marked_optimised


# Test files whose engines build programs of the same shapes (the same tiny model, pages and
# buckets: test_eagle.py's KW, test_dflash.py's), each group one unit of `--dist loadfile`: on one
# xdist worker a later file may find an earlier one's compiles in the persistent cache, where on
# two at once both compile. One cold suite each with the plugin of bench/probes/suite_compiles.py:
# 507 s with the groups against 540 s without, compiles summed 548 s against 585
# (suite_compiles-s86-grouped-, -s86-); cold runs have spread 518-609 s from run to run.
SAME_WORKER = {"tests/test_closed_wave.py": "eagle-engines", "tests/test_spec_policy.py": "eagle-engines",
               "tests/test_eagle.py": "eagle-engines", "tests/test_token_map.py": "eagle-engines",
               "tests/test_dflash.py": "dflash-engines", "tests/test_tp.py": "dflash-engines",
               "tests/test_rollout.py": "dflash-engines"}


@pytest.hookimpl(optionalhook=True)  # (xdist's hook: a run without xdist has no such hook)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedPrograms(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SAME_WORKER.get(path, path)
    return SharedPrograms(config, log)


def subprocess_env() -> dict:
    """The environment of a test's child process that runs SmolLM2: without the flags that slow
    its programs down (as the per-compile options above spare this process's big programs)."""
    slow = set(FAST_FLAGS.split()[1:]) | {OLD_EMITTERS}
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in slow)
    return env

from jaxspec.models import Llama, ModelConfig


# One engine shape for every SmolLM2 test: their programs are then compiled once (the persistent
# cache is shared by the test workers); SmolLM2's unrolled layers are the suite's costliest compiles.
SMOL_KW = dict(max_batch=4, max_seq_len=256, num_pages=80)


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


def run_mixed_requests_with_aborts(gen, rng, n=1000):
    """n random requests (greedy/sampled, random stops and lengths); every fifth call aborts one
    of the last 30 (waiting, running or finished). Afterwards no page may be in use."""
    from jaxspec import SamplingParams
    sched = gen.scheduler
    reqs = []
    for i in range(n):
        prompt = list(map(int, rng.integers(0, 64, rng.integers(1, 20))))
        p = SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=float(rng.choice([0.0, 1.0])),
                           seed=i, stop_token_ids=[int(rng.integers(0, 64))])
        reqs.append(sched.add(prompt, p))
        if i % 7 == 0:
            sched.step()
        if i % 5 == 0:
            sched.abort(reqs[int(rng.integers(max(0, len(reqs) - 30), len(reqs)))])
    while sched.has_work:
        sched.step()
    assert all(r.finished for r in reqs)
    assert sum(r.finish_reason == "abort" for r in reqs) > 10
    sched.pool.check()
    assert sched.pool.in_use == 0


def drafter_cache_after(gens, prompt, outputs=30):
    """Each engine's drafter cache (K at layer 0) over one request's committed tokens, once it
    emitted `outputs` tokens (the slots both engines committed: a head's pair needs the token
    after it too), and the requests."""
    import numpy as np
    from jaxspec import SamplingParams
    reqs = [g.submit(prompt, SamplingParams(max_tokens=2 * outputs, ignore_eos=True)) for g in gens]
    for g, r in zip(gens, reqs):
        while len(r.output_ids) < outputs:
            g.scheduler.step()
    n, ps = min(r.kv_len for r in reqs) - 1, gens[0].scheduler.page_size
    return [np.asarray(g.scheduler.cache[1].k[0])[[r.pages[i // ps] for i in range(n)], [i % ps for i in range(n)]]
            for g, r in zip(gens, reqs)], reqs


@pytest.fixture(autouse=True)
def step_clock_ticks(monkeypatch):
    """Whether a host drafter drafts depends on timed steps (spec_policy.SpecPolicy); wall time
    would make that, and every accept-length assertion, depend on the test machine. Here every
    read-back is one tick and any gain will do, so drafting always pays; tests of the policy
    drive the clock and set spec_min_gain."""
    import itertools
    from jaxspec import scheduler
    monkeypatch.setattr(scheduler.Scheduler, "clock", staticmethod(itertools.count().__next__))
    monkeypatch.setattr(scheduler, "DEFAULT_SPEC_MIN_GAIN", 0.0)


def train_tiny_head(tmp, kind, model=None, steps=80):
    from flax import nnx
    from jaxspec import train
    argv = ["--run", str(tmp), "--kind", kind, "--num-prompts", "96", "--max-new-tokens", "40", "--seq-len", "64",
            "--steps", str(steps), "--batch", "8", "--ttt", "3", "--draft-vocab", "48", "--log-every", "20",
            "--save-every", "1000", "--gen-batch", "48", "--lr", "3e-3", "--export", str(tmp / "head"),
            "--export-dtype", "float32"]
    return train.train(train.parse_args(argv), model or Llama(TINY, rngs=nnx.Rngs(3)))


@pytest.fixture(scope="session")
def tiny_eagle3(tmp_path_factory, tiny):
    """A tiny EAGLE-3 head trained on the tiny target's own text (tmp/head)."""
    tmp = tmp_path_factory.mktemp("eagle3")
    train_tiny_head(tmp, "eagle3", tiny)
    return tmp


@pytest.fixture(scope="session")
def tiny_dflash(tmp_path_factory, tiny):
    """A tiny DFLASH drafter (block 4, 2 layers) trained on the tiny target's own text (tmp/drafter)."""
    from jaxspec import train
    tmp = tmp_path_factory.mktemp("dflash")
    argv = ["--run", str(tmp), "--drafter", "dflash", "--num-prompts", "96", "--max-new-tokens", "40",
            "--seq-len", "64", "--steps", "150", "--batch", "8", "--block-size", "4", "--draft-layers", "2",
            "--anchors", "8", "--log-every", "25", "--save-every", "1000", "--gen-batch", "48", "--lr", "3e-3",
            "--export", str(tmp / "drafter"), "--export-dtype", "float32"]
    train.train(train.parse_args(argv), tiny)
    return tmp
