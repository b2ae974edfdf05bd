"""Every example in the README runs and prints what the README says it prints (the text after
`print(...)  #`). The server example runs against the app its command line describes, served
in-process on a free port."""
import contextlib
import io
import re
import shlex

import pytest

README = open(__file__.rsplit("/tests/", 1)[0] + "/README.md").read()
BLOCKS = re.findall(r"```(python|bash)\n(.*?)```", README, re.S)


def python_blocks():
    return [code for lang, code in BLOCKS if lang == "python"]


def run_and_check(code, url=None):
    if url is not None:
        code = code.replace("http://127.0.0.1:8000", url)
    expected = re.findall(r"^print\(.*\)\s+#\s*(.+)$", code, re.M)
    assert expected, "a README example prints nothing it promises"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    for want in expected:
        assert want.strip() in out.getvalue(), (want, out.getvalue())


def test_readme_names_three_examples():
    kinds = [("Generator" in c, "OpenAI(" in c, "jit_rollout" in c) for c in python_blocks()]
    assert [sum(k) for k in zip(*kinds)] == [1, 1, 1]
    assert len(README.splitlines()) < 200


@pytest.mark.parametrize("which", ["Generator", "jit_rollout"])
def test_readme_python_examples(which):
    run_and_check(next(c for c in python_blocks() if which in c))


def test_readme_server_example():
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import server as srv
    command = next(c for lang, c in BLOCKS if lang == "bash" and "server.py" in c)
    argv = shlex.split(command.replace("\\\n", " "))
    argv = argv[argv.index("server.py") + 1:] + ["--skip-warmup"]
    app, _ = srv.build_app(argv)
    url, server, th = srv.start_in_thread(app)
    try:
        run_and_check(next(c for c in python_blocks() if "OpenAI(" in c), url)
    finally:
        server.should_exit = True
        th.join(timeout=30)
