"""The fixed program set: its size, built at start-up, and no compile after it."""

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import TINY
from jaxspec import Generator, SamplingParams, SpecConfig
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.program_store import compile_count
from jaxspec.sampling import SamplerFlags


def test_program_set_is_small_and_listed(tiny, capsys):
    plain = Generator(tiny, None, max_batch=64, max_seq_len=256)
    # 5 prefill shapes (3 of up to 16 rows, 2 of 64) + a decode step for each of 7 batch buckets; one program
    # serves greedy and sampled batches
    assert len({plain.scheduler.programs.entry(*s[1:]) for s in plain.scheduler.program_specs()}) == 5 + 7
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1))
    eagle = Generator(tiny, None, drafter=EagleDrafter(head, TreeShape(3, 4, 8)), max_batch=64, max_seq_len=256)
    specs = eagle.scheduler.program_specs()
    # prefill 5 (and 5 by the target alone, for bucket 64, which gets no tree), plain decode 7, and verify for
    # the buckets whose tree keeps its 8 nodes (1..16): 5, greedy and sampling apart (one program serves both
    # for the others: programs.SHARED_SAMPLER)
    assert len({progs.entry(*s) for progs, *s in specs}) == 5 + 5 + 7 + 2 * 5
    assert sum(s[1] == "verify_steps" for s in specs) == 2 * 5
    small = Generator(tiny, None, drafter=EagleDrafter(head, TreeShape(3, 4, 8)), max_batch=2, max_seq_len=256)
    info = small.scheduler.warmup(progress=True)  # buckets 1 and 2: prefill 3 (rows <= 2), decode 2, verify 2 twice
    assert info["programs"] == 3 + 2 + 2 * 2
    assert info["seconds"] == pytest.approx(info["workers_s"] + info["build_s"] + info["costs_s"])
    assert f"{info['programs']} programs ready in" in capsys.readouterr().err  # (a server's log says where its start went)
    lines = small.scheduler.programs.listing()
    assert len(lines) == 3 + 2 * 2 and sum(l.startswith("verify_steps") for l in lines) == 4


def test_no_compile_after_warmup_over_varied_requests(tiny):
    gen = Generator(tiny, None, max_batch=8, max_seq_len=160, prefill_chunk=64, warmup=True)
    before = compile_count()
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 63, n))) for n in (1, 3, 17, 40, 63, 64, 65, 130, 5, 9, 2)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 20)), temperature=float(t), top_p=p, seed=i)
              for i, (t, p) in enumerate(zip(rng.choice([0.0, 0.8], len(prompts)), rng.choice([1.0, 0.9], len(prompts))))]
    warm = gen.generate(prompts, params)
    for k in (1, 3, 8):  # other batch sizes
        gen.generate(prompts[:k], params[:k])
    assert gen.scheduler.late_compiles == []
    assert compile_count() == before, "a program was compiled after warm-up"
    cold = Generator(tiny, None, max_batch=8, max_seq_len=160, prefill_chunk=64).generate(prompts, params)
    assert [c.token_ids for c in warm] == [c.token_ids for c in cold]


def test_eagle_engine_compiles_nothing_after_warmup_with_mixed_groups(tiny):
    """At 40 requests trees do not fit: they prefill and decode plainly and leave the head behind
    (and stay plain). Once 30 finish, 13 new requests verify trees beside them: 23 decoding
    requests (bucket 32: 4-node trees), of which the 13 speculative ones are a group of their own,
    launched in the whole batch's bucket, for which the start-up set holds that tree size."""
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1))
    # greedy requests only: the greedy half of the start-up set (the sampled half adds compiles, not cases)
    gen = Generator(tiny, None, drafter=EagleDrafter(head, TreeShape(3, 4, 8)), max_batch=64, max_seq_len=160,
                    prefill_chunk=64, warmup=True, spec_min_nodes=4, warmup_flags=(SamplerFlags(),))
    before = compile_count()
    sched = gen.scheduler
    reqs = [sched.add([1 + i % 50, 2, 3, 4], SamplingParams(max_tokens=6 if i % 4 else 30, ignore_eos=True))
            for i in range(40)]
    while sum(r.finished for r in reqs) < 30:
        sched.step()
    assert all(r.head_len is not None for r in reqs if not r.finished)
    assert sched.stats["verify_steps"] == 0
    reqs += [sched.add([5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True)) for _ in range(13)]
    while sched.has_work:
        sched.step()
    assert all(r.finished for r in reqs) and sched.stats["verify_steps"] > 0
    assert sched.late_compiles == [] and compile_count() == before


def test_auto_engine_whose_top_bucket_has_no_tree_compiles_nothing_as_its_batch_shrinks(tiny):
    """Under 'auto' a batch of 16 gets no tree at this budget (bucket 8 does): its requests decode
    plainly there, leaving their heads behind, and decode on by the target alone as finished ones
    shrink the batch into buckets whose plain decoding keeps the heads in step: the start-up set
    holds those buckets' target-alone programs too."""
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1))
    gen = Generator(tiny, None, drafter=EagleDrafter(head, TreeShape(3, 4, 8)), max_batch=16, max_seq_len=160,
                    prefill_chunk=64, warmup=True, spec_min_nodes=4, spec_policy="auto", spec_max_verify_tokens=32,
                    warmup_flags=(SamplerFlags(),))
    sched = gen.scheduler
    assert not sched._verify_shapes(16) and sched._keeps_heads_at(8) and sched._keeps_heads_at(4)
    reqs = [sched.add([1 + i, 2, 3, 4], SamplingParams(max_tokens=4 if i % 4 else 40, ignore_eos=True))
            for i in range(16)]
    while sched.has_work:
        sched.step()
    assert all(r.finished and r.head_len is not None for r in reqs)
    assert sched.late_compiles == []


@pytest.fixture
def without_jax_cache():
    """JAX's persistent cache (conftest shares one across the suite) off: every compile is XLA's own."""
    from jax.experimental.compilation_cache import compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


def test_a_second_start_reads_its_programs_back_from_the_store(tiny, tmp_path, without_jax_cache):
    """Programs kept by one engine (exported and compiled) are read back, not traced nor compiled,
    by the next engine of the same model and drafter; a damaged executable is rebuilt from its
    exported module, a program with both damaged is traced again; outputs equal those of
    programs traced anew."""
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1))
    kw = dict(max_batch=1, max_seq_len=128, prefill_chunk=32)  # one batch bucket: each engine builds half the programs
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = [SamplingParams(max_tokens=20, ignore_eos=True), SamplingParams(max_tokens=9, temperature=0.9, seed=4)]

    def engine(store):
        gen = Generator(tiny, None, drafter=EagleDrafter(head, TreeShape(3, 2, 6)), **kw)
        for progs in (gen.scheduler.programs, gen.scheduler.plain_programs):
            progs.store = store
        c0 = compile_count()
        info = gen.scheduler.warmup()
        groups = (gen.scheduler.programs, gen.scheduler.plain_programs)
        reads = [sum(p.store_reads for p in groups), sum(p.executable_reads for p in groups), compile_count() - c0]
        return gen, info["programs"], reads

    first, n, reads1 = engine(str(tmp_path))  # an empty store: every program traced and compiled
    exported, compiled = sorted(tmp_path.glob("*.jaxexport")), sorted(tmp_path.glob("*.xlaexe"))
    cuts = len(first.scheduler.cuts.table)  # the prefill's drafts cut on the device: tiny, compiled each start
    assert cuts == 1 and reads1 == [0, 0, n + cuts] and len(exported) == len(compiled) == n
    again, _, reads = engine(str(tmp_path))
    assert reads == [n, n, cuts], "a program was traced or compiled again"
    files = [(tmp_path / progs.entry(*spec), tmp_path / progs._executable_name(*spec))
             for progs, *spec in again.scheduler.program_specs()]
    files = list(dict.fromkeys(files))  # one pair a program
    assert {e for e, _ in files} == set(exported) and {x for _, x in files} == set(compiled)
    for f in (*files[0], files[1][1]):  # the first program's both files, the second's executable
        f.write_bytes(b"damaged")
    second, n2, reads2 = engine(str(tmp_path))
    assert n2 == n and reads2 == [n - 1, n - 2, 2 + cuts]
    expect = [o.token_ids for o in first.generate(prompts, params)]
    assert [o.token_ids for o in second.generate(prompts, params)] == expect
    assert second.scheduler.late_compiles == []


def test_a_cold_start_builds_its_programs_in_worker_processes(tiny, tmp_path):
    """Worker processes export and compile the missing programs from shapes alone; the engine
    then reads every one back and finds every executable in the compilation cache."""
    import jax
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1))
    gen = Generator(tiny, None, drafter=EagleDrafter(head, TreeShape(3, 2, 6)), max_batch=2, max_seq_len=128,
                    prefill_chunk=32, build_workers=2)
    groups = (gen.scheduler.programs, gen.scheduler.plain_programs)
    for progs in groups:
        progs.store = str(tmp_path)
    events, recording = [], [True]
    jax.monitoring.register_event_listener(lambda e, **_: recording[0] and events.append(e))

    def cuts_build(specs, build=gen.scheduler.cuts.build):
        recording[0] = False  # the prefill's tiny cut programs are compiled here, after the workers' programs
        return build(specs)
    gen.scheduler.cuts.build = cuts_build
    info = gen.scheduler.warmup()
    assert len(list(tmp_path.glob("*.jaxexport"))) == info["programs"]
    assert sum(p.store_reads for p in groups) == info["programs"], "the engine traced a program itself"
    assert "/jax/compilation_cache/cache_misses" not in events
    traced = Generator(tiny, None, drafter=EagleDrafter(head, TreeShape(3, 2, 6)), max_batch=2, max_seq_len=128,
                       prefill_chunk=32)
    for progs in (traced.scheduler.programs, traced.scheduler.plain_programs):
        progs.store = None
    prompts, params = [[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in traced.generate(prompts, params)]


def test_failed_program_workers_leave_the_build_to_the_engine(tiny, tmp_path, monkeypatch):
    import sys

    import pytest
    gen = Generator(tiny, None, max_batch=2, max_seq_len=128, prefill_chunk=32, build_workers=2)
    gen.scheduler.programs.store = str(tmp_path)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # every worker exits 1 at once
    with pytest.warns(UserWarning, match="2 of 2 program workers failed"):
        info = gen.scheduler.warmup()
    assert gen.scheduler.programs.store_reads == 0 and info["programs"] == len(list(tmp_path.glob("*.jaxexport")))
    assert gen.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids


def test_skip_temp_update_mode_is_requested_only_where_the_xla_knows_it(monkeypatch):
    """XLA_FLAGS gets SKIP_TEMP only with a CUDA plugin and jaxlib >= 0.11.2 (jaxlib 0.10.2 aborts
    on the flag) before any backend starts, and not for `python -m jaxspec.train`; a flag already set
    is left as it is."""
    from jax._src import xla_bridge

    from jaxspec import compile_options as co
    versions = {"jaxlib": (0, 11, 2), "jax-cuda12-plugin": (0, 11, 2)}
    monkeypatch.setattr(co, "_version", lambda dist: versions.get(dist))
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    assert co.request_stable_temps()
    assert co._MODE_FLAG + "=SKIP_TEMP" in co.os.environ["XLA_FLAGS"]
    assert co.os.environ["XLA_FLAGS"].startswith("--xla_foo=1 ")
    assert co.update_mode() == "SKIP_TEMP"
    monkeypatch.setenv("XLA_FLAGS", "")
    versions["jaxlib"] = (0, 10, 2)
    assert not co.request_stable_temps() and co.os.environ["XLA_FLAGS"] == ""
    versions["jaxlib"], versions["jax-cuda12-plugin"] = (0, 11, 2), None
    assert not co.request_stable_temps()  # no CUDA plugin: a CPU machine
    versions["jax-cuda12-plugin"] = (0, 11, 2)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert not co.request_stable_temps()  # too late: the client has read XLA_FLAGS
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(co.sys, "orig_argv", ["python3", "-m", "jaxspec.train", "--kind", "eagle3"], raising=False)
    assert not co.request_stable_temps() and co.os.environ["XLA_FLAGS"] == ""  # training keeps XLA's default
    monkeypatch.setattr(co.sys, "orig_argv", ["python3", "bench/spec.py", "-m", "x"], raising=False)
    assert co.request_stable_temps()
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(co, "CMDBUF_UPDATE_MODE", "")
    assert not co.request_stable_temps() and co.os.environ["XLA_FLAGS"] == ""


@pytest.mark.parametrize("algo", ["EAGLE3", "NGRAM"])
def test_warmup_runs_each_program_once_and_outputs_stay_a_cold_engines(tiny, algo):
    """On a GPU the warm-up runs every program of the set once (its first run loads its kernels, a
    stall the first call to meet it would pay); forced here on the CPU: each program ran once, the
    runs' writes (the trash page) change no output, nothing compiles after, every page comes back."""
    def engine(first_runs):
        drafter = (EagleDrafter(DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1)), TreeShape(3, 2, 4))
                   if algo == "EAGLE3" else SpecConfig("NGRAM", num_draft_tokens=4).build(tiny))
        gen = Generator(tiny, None, drafter=drafter, max_batch=2, max_seq_len=128, prefill_chunk=32)
        gen.scheduler.first_runs = first_runs
        return gen
    gen = engine(True)
    sched, ran = gen.scheduler, []
    for progs in {id(s[0]): s[0] for s in sched.program_specs()}.values():
        run = progs.run
        progs.run = lambda name, flags, cache, args, run=run, progs=progs: ran.append(progs.key(name, flags, cache, args)) \
            or run(name, flags, cache, args)
    sched.warmup(flag_sets=(SamplerFlags(),))
    built = {key for s in sched.program_specs() for key in s[0].table}
    assert len(ran[:len(built)]) == len(set(ran[:len(built)])) and set(ran) == built  # each once (then the costs' timing)
    before = compile_count()
    prompts = [[5, 9, 2, 7] * 3, [1, 2, 3], [8] * 20]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    warm = [c.token_ids for c in gen.generate(prompts, params)]
    assert sched.late_compiles == [] and compile_count() == before
    assert warm == [c.token_ids for c in engine(False).generate(prompts, params)]
    sched.pool.check()
    assert sched.pool.in_use == 0
