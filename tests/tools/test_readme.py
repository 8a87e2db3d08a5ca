"""The documentation's examples run: every block marked `<!-- ci: runs -->` in README.md and
docs/USAGE.md, in real processes.

A small parser takes the marked blocks out of each file; placeholders (`model`, `hf_model`,
`train_step`, `for step in ...`, `hand_to_engine`, `path/to/config.json`) are filled with a tiny
Llama built locally from a transformers config (nothing from a model hub). The Python examples run
their trainer and engine halves as separate processes and end with the engine's weights compared,
by fingerprint in the wire dtype, with the trainer's live weights. The quick start's venv and
install are not re-run: its `refit demo` part runs (with the tiny model's flags). Each marked block
is one test, named by its file and line (`README.md:15`, `docs/USAGE.md:58`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
from locations import ROOT, SRC, pythonpath

README = os.path.join(ROOT, "README.md")
USAGE = os.path.join(ROOT, "docs", "USAGE.md")
DOCS = (README, USAGE)
"""The files whose marked blocks run."""
CI = os.path.join(ROOT, ".ci", "run")
MARK = "<!-- ci: runs -->"
TINY_DEMO = "--layers 2 --hidden 128 --bucket-bytes 262144 --steps 2 --dtype-change-at 0".split()
"""The demo's tiny model: several buckets, a dtype change, seconds per refit on 2 cores."""
STEPS = "range(1, 3)"
"""What `for step in ...:` iterates in the Python examples: two refits."""


@dataclass(frozen=True)
class Block:
    """A fenced block marked `<!-- ci: runs -->`."""

    path: str
    line: int
    """1-based line of the opening fence."""
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def marked_blocks(text: str, name: str = "README.md") -> list[tuple[int, str, str]]:
    """(line of the fence, language, code) of every fenced block right after a `<!-- ci: runs -->` line."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == MARK:
            fence = lines[i + 1].strip()
            assert fence.startswith("```"), f"{name} line {i + 2}: {MARK} must sit right above a fenced block"
            end = lines.index("```", i + 2)
            blocks.append((i + 2, fence[3:], "\n".join(lines[i + 2 : end])))
            i = end
        i += 1
    return blocks


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _blocks(path: str) -> list[Block]:
    name = os.path.relpath(path, ROOT)
    return [Block(path, line, lang, code) for line, lang, code in marked_blocks(_read(path), name)]


def _all_blocks() -> list[Block]:
    return [b for path in DOCS for b in _blocks(path)]


def _kind(block: Block) -> str | None:
    """Which runner a marked block needs; None when no runner knows it (a test then fails)."""
    code = block.code
    if "python3 -m venv" in code and "refit demo" in code:
        return "quick start"
    if (
        block.language == "bash"
        and _commands(code)
        and all(line.strip().startswith("refit ") for line in code.splitlines() if line.strip())
    ):
        return "commands"
    if block.language == "python" and "# engine process" in code:
        return "use"
    if block.language == "python" and "sharded_refit" in code:
        return "fsdp"
    return None


_FILES = [pytest.param(path, id=os.path.relpath(path, ROOT)) for path in DOCS]


@pytest.mark.parametrize(
    ("path", "kinds"),
    [
        pytest.param(README, ["quick start"], id="README.md"),  # the quick start alone
        pytest.param(USAGE, ["commands", "use", "fsdp"], id="docs/USAGE.md"),  # more of the demo, Use, FSDP2
    ],
)
def test_the_docs_list_the_blocks_ci_runs_and_mark_the_others(path: str, kinds: list[str]) -> None:
    text = _read(path)
    blocks = _blocks(path)
    assert [_kind(b) for b in blocks] == kinds, [(b.id, _kind(b)) for b in blocks]
    unmarked = re.findall(r"\n\n```", text)  # every block carries a ci: line saying whether it runs
    assert not unmarked, f"a {os.path.relpath(path, ROOT)} code block without a `<!-- ci: ... -->` line above it"


def test_more_of_the_demo_lists_the_cpu_commands() -> None:
    [more] = [b for b in _all_blocks() if "refit bench --quick" in b.code]
    assert len(_commands(more.code)) == 7, more.code
    assert any("refit plan" in b.code for b in _all_blocks())


def _sessions_made(code: str) -> list[str]:
    """The lines of `code` that make a Sender or a Receiver."""
    lines = [line.lstrip().removeprefix("# ").split(":  ")[-1] for line in code.splitlines()]  # comments too
    return [line for line in lines if re.search(r"\b(Sender|Receiver)\(", line)]


@pytest.mark.parametrize("path", _FILES)
def test_every_example_opens_its_sender_and_receiver_as_context_managers(path: str) -> None:
    python = re.findall(r"```python\n(.*?)```", _read(path), flags=re.S)
    made = [line for code in python for line in _sessions_made(code)]
    assert made and all(line.lstrip().startswith("with ") or "RankedRefit(" in line for line in made), (
        made
    )  # RankedRefit owns its Sender and closes it
    assert any("with Receiver(" in line for line in made)


def _fences(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readme_example_is_usages_use_example_which_runs() -> None:
    """The README's one example is not run a second time: it is, character for character, the Use
    example of docs/USAGE.md, which runs (test_marked_block_runs)."""
    [example] = _fences(_read(README))
    [use] = [b for b in _blocks(USAGE) if _kind(b) == "use"]
    assert example.rstrip("\n") == use.code


def _pytest_steps(code: str) -> list[str]:
    return [step.strip() for step in code.split("&&")]


def test_the_readmes_test_commands_are_what_ci_runs() -> None:
    """.ci/run runs the README's two test commands (each step of them, one line each, bar its -q pip flags)."""
    text = _read(README)
    commands = [c for c in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if "pytest" in c]
    assert len(commands) == 2, commands  # the fast tier, the full suite
    ci = [line.strip() for line in _read(CI).splitlines()]
    for code in commands:
        for step in _pytest_steps(code):
            if step.startswith("python3 -m venv") or step.startswith(". "):
                continue  # CI makes its venvs itself (the fast tier's outside the checkout)
            step = step.replace("pip ", "python -m pip ", 1) if step.startswith("pip ") else step
            step = step.replace("pip install ", "pip install -q ").replace("pip uninstall -y", "pip uninstall -q -y")
            assert step in ci, (step, CI)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath(SRC), "OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def _refit(line: str, tmp_path) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    argv = shlex.split(line.split("#")[0])
    assert argv[0] == "refit", line
    argv = [a.replace("path/to/config.json", str(_config_json(tmp_path))) for a in argv[1:]]
    if argv[0] == "demo":
        argv += TINY_DEMO
    return subprocess.run([sys.executable, "-m", "refit", *argv], capture_output=True, text=True, env=_env())


def _config_json(tmp_path) -> str:  # type: ignore[no-untyped-def]
    from refit.tools.demo.model import model_config

    path = tmp_path / "config.json"
    path.write_text(model_config(layers=2, hidden=128, ffn=384).to_json_string())
    return str(path)


def _commands(code: str) -> list[str]:
    return [line for line in code.splitlines() if line.strip().startswith("refit ")]


def _run_quick_start(block: Block, tmp_path) -> None:  # type: ignore[no-untyped-def]
    steps = [s.strip() for s in block.code.split("&&")]
    assert steps[0] == "python3 -m venv .venv" and "pip install -e '.[demo]'" in steps
    assert steps[-1] == "refit demo"  # the install is not re-run here; the demo is
    result = _refit(steps[-1], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("all refits verified") == 2  # shm, then gloo


def _run_commands(block: Block, tmp_path) -> None:  # type: ignore[no-untyped-def]
    for line in _commands(block.code):
        result = _refit(line, tmp_path)
        assert result.returncode == 0, line + "\n" + result.stdout + result.stderr[-3000:]
        if " demo " in f" {line} ":
            assert "all refits verified" in result.stdout + result.stderr, line
        if "--json" in line:
            json.loads(result.stdout)


PRELUDE = """
import json, os, sys
import torch
from refit.checks.fingerprints import fingerprints
from refit.tools.demo.model import build_model, model_config

CONFIG = model_config(layers=2, hidden=128, ffn=384)
IDS = torch.randint(0, CONFIG.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))

def hand_to_engine(info):
    print("INFO " + json.dumps(info), flush=True)
    return info

def report(tag, model):
    tensors = model.state_dict(keep_vars=True).items()
    held = tag == "HELD"
    print(tag + " " + json.dumps(fingerprints(tensors, WIRE, held=held)), flush=True)

class _Wire(dict):
    def __missing__(self, name):
        return torch.bfloat16
WIRE = _Wire()
"""

TRAINER = """
model = build_model(CONFIG, seed=0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

def train_step():
    model(IDS, labels=IDS).loss.backward()
    opt.step()
    opt.zero_grad()
"""

ENGINE = """
info = json.loads(sys.argv[1])
hf_model = build_model(CONFIG, seed=1)

def generate():
    with torch.no_grad():
        hf_model(IDS)
"""

FSDP = """
import torch.distributed as dist
from refit.sources.fsdp import full_tensor

model = build_model(CONFIG, seed=0)  # the example shards it, then trains it
_opt = []

def train_step():
    if not _opt:  # built on the parameters as the example sharded them
        _opt.append(torch.optim.AdamW(model.parameters(), lr=1e-2))
    model(IDS, labels=IDS).loss.backward()
    _opt[0].step()
    _opt[0].zero_grad()
"""

FSDP_END = """
with torch.no_grad():
    live = {n: full_tensor(t) for n, t in model.state_dict(keep_vars=True).items()}
if rank == 0:
    print("LIVE " + json.dumps(fingerprints(live.items(), WIRE)), flush=True)
"""


KEEP_ALIVE = """
sys.stdin.read()  # alive (waiting to join the engine process, say) until the engine has ended
"""


def _fill(code: str) -> str:
    """The examples' placeholders: two steps, and the rendezvous handed to the engine process."""
    code = re.sub(r"for (\w+) in \.\.\.:", rf"for \1 in {STEPS}:", code)
    return code.replace("info = sender.rendezvous()", "info = hand_to_engine(sender.rendezvous())")


def _script(tmp_path, name: str, *parts: str) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / name
    path.write_text("\n".join(textwrap.dedent(p) for p in parts))
    return str(path)


def _use_halves(code: str) -> tuple[str, str]:
    trainer, engine = code.split("# engine process")
    return _fill(trainer), engine


def _use_example(path: str) -> str:
    """The Use example the FSDP2 example's engine half comes from: the one in `path`, else the first."""
    uses = [b for b in _blocks(path) if _kind(b) == "use"] or [b for b in _all_blocks() if _kind(b) == "use"]
    return uses[0].code


def _session(tmp_path, trainers: list[list[str]], engine: str, env_of=lambda rank: {}) -> None:  # type: ignore[no-untyped-def]
    """Start the trainer process(es), hand rank 0's rendezvous to the engine process, and check that the
    engine ends with the trainer's live weights (in the wire dtype, bitwise)."""
    procs = []
    for rank, cmd in enumerate(trainers):
        log = open(tmp_path / f"trainer{rank}.err", "w")  # noqa: SIM115 - closed with the process below
        out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        env = {**_env(), **env_of(rank)}
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=log, text=True, env=env)
        procs.append((p, log))
    lead = procs[0][0]
    lines = []
    for line in lead.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if line.startswith("INFO "):
            break
    info = next((line[5:] for line in lines if line.startswith("INFO ")), None)
    assert info, f"no rendezvous from the trainer: {lines} {(tmp_path / 'trainer0.err').read_text()[-3000:]}"
    eng = subprocess.run([sys.executable, engine, info.strip()], capture_output=True, text=True, env=_env())
    rest = ""
    for line in lead.stdout:  # type: ignore[union-attr]  # the engine ended while the trainer is still alive
        rest += line
        if line.startswith("LIVE "):
            break
    for p, _ in procs:
        p.stdin.close()  # type: ignore[union-attr]  # now the trainer may exit
    codes = [p.wait() for p, _ in procs]
    for _, log in procs:
        log.close()
    errors = "".join((tmp_path / f"trainer{r}.err").read_text()[-2000:] for r in range(len(procs)))
    assert codes == [0] * len(procs) and eng.returncode == 0, errors + eng.stdout + eng.stderr[-3000:]
    live = json.loads(next(line[5:] for line in rest.splitlines() if line.startswith("LIVE ")))
    held = json.loads(next(line[5:] for line in eng.stdout.splitlines() if line.startswith("HELD ")))
    assert held == live and len(live) > 10  # no "lossy:" either: the engine holds exactly the bf16 values


def _run_use(block: Block, tmp_path) -> None:  # type: ignore[no-untyped-def]
    trainer, engine = _use_halves(block.code)
    t = _script(tmp_path, "trainer.py", PRELUDE, TRAINER, trainer, 'report("LIVE", model)', KEEP_ALIVE)
    e = _script(tmp_path, "engine.py", PRELUDE, ENGINE, engine, 'report("HELD", hf_model)')
    _session(tmp_path, [[sys.executable, t]], e)


def _run_fsdp(block: Block, tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = _fill(block.code)
    end = "dist.destroy_process_group()"
    assert code.rstrip().endswith(end), "the FSDP2 example ends by destroying its process group"
    code = code.rstrip().removesuffix(end) + FSDP_END + "dist.barrier()\n" + end + "\n"
    _, engine = _use_halves(_use_example(block.path))
    t = _script(tmp_path, "fsdp_trainer.py", PRELUDE, FSDP, code, KEEP_ALIVE)
    e = _script(tmp_path, "engine.py", PRELUDE, ENGINE, engine, 'report("HELD", hf_model)')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    _session(tmp_path, [[sys.executable, t]] * 2, e, env_of=lambda rank: {**env, "RANK": str(rank)})


RUNNERS = {"quick start": _run_quick_start, "commands": _run_commands, "use": _run_use, "fsdp": _run_fsdp}
"""How each kind of marked block runs. Every one starts processes: all are in the slow tier."""


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=pytest.mark.slow) for b in _all_blocks()])
def test_marked_block_runs(block: Block, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """quick start: its `refit demo`; commands: each `refit` line; use: trainer and engine processes end
    bitwise equal; fsdp: two FSDP2 ranks into the Use example's engine half, bitwise equal."""
    kind = _kind(block)
    assert kind in RUNNERS, f"{block.id}: marked `{MARK}`, but no runner in this test knows this block"
    RUNNERS[kind](block, tmp_path)


def test_the_docs_say_the_fingerprint_compares_in_the_wire_dtype_for_every_wire_dtype() -> None:
    readme = " ".join(_read(README).split())
    assert "trainer's live tensor cast to its wire dtype" in readme  # the quick start's demo
    usage = " ".join(_read(USAGE).split())
    use = usage[usage.index('`Sender(..., verify="fingerprint")`') :][:1500]
    for case in ("cast to that wire dtype", "trainer's own", "wider", "narrower", "rounded to bf16", "slice"):
        assert case in use, case


def _extras() -> set[str]:
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def test_the_readme_lists_every_extra() -> None:
    text = _read(README)
    listed = text[text.index("Extras, each") : text.index("`refit doctor` then says")]
    missing = [name for name in sorted(_extras()) if f"`{name}`" not in listed]
    assert not missing, missing


def test_the_trl_install_line_names_real_extras_and_the_full_suites_uninstall() -> None:
    text = _read(USAGE)
    section = text[text.index("**refit in TRL**") :]
    [line] = [ln for ln in section[: section.index("A `GRPOTrainer`")].splitlines() if ln.startswith("pip install")]
    extras = re.search(r"'\.\[([a-z,-]+)\]'", line).group(1).split(",")  # type: ignore[union-attr]
    assert "trl" in extras and set(extras) <= _extras(), line
    uninstall = re.search(r"pip uninstall -y [a-z ]+", _read(README))
    assert uninstall and uninstall.group(0).strip() in line, line
