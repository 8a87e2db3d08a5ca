"""The README's examples run: every block marked `<!-- ci: runs -->` in README.md, in real processes.

A small parser takes the marked blocks out of README.md; placeholders (`model`, `hf_model`,
`train_step`, `for step in ...`, `hand_to_engine`, `path/to/config.json`) are filled with a tiny
Llama built locally from a transformers config (nothing from a model hub). The Python examples run
their trainer and engine halves as separate processes and end with the engine's weights compared,
by fingerprint in the wire dtype, with the trainer's live weights. The quick start's venv and
install are not re-run: its `refit demo` part runs (with the tiny model's flags).
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

import pytest
from locations import ROOT, SRC, pythonpath

README = os.path.join(ROOT, "README.md")
MARK = "<!-- ci: runs -->"
TINY_DEMO = "--layers 2 --hidden 128 --bucket-bytes 262144 --steps 2 --dtype-change-at 0".split()
"""The demo's tiny model: several buckets, a dtype change, seconds per refit on 2 cores."""
STEPS = "range(1, 3)"
"""What `for step in ...:` iterates in the Python examples: two refits."""


def marked_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block right after a `<!-- ci: runs -->` line."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == MARK:
            fence = lines[i + 1].strip()
            assert fence.startswith("```"), f"README line {i + 2}: {MARK} must sit right above a fenced block"
            end = lines.index("```", i + 2)
            blocks.append((fence[3:], "\n".join(lines[i + 2 : end])))
            i = end
        i += 1
    return blocks


def _blocks() -> list[tuple[str, str]]:
    with open(README) as f:
        return marked_blocks(f.read())


def _one(predicate) -> str:  # type: ignore[no-untyped-def]
    [code] = [code for _, code in _blocks() if predicate(code)]
    return code


def test_the_readme_lists_the_blocks_ci_runs_and_marks_the_others() -> None:
    with open(README) as f:
        text = f.read()
    codes = [code for _, code in marked_blocks(text)]
    assert len(codes) == 4, codes  # quick start, more of the demo, Use, FSDP2
    assert any("refit bench --quick" in c for c in codes) and any("refit plan" in c for c in codes)
    unmarked = re.findall(r"\n\n```", text)  # every block carries a ci: line saying whether it runs
    assert not unmarked, "a README code block without a `<!-- ci: ... -->` line above it"


def _sessions_made(code: str) -> list[str]:
    """The lines of `code` that make a Sender or a Receiver."""
    lines = [line.lstrip().removeprefix("# ").split(":  ")[-1] for line in code.splitlines()]  # comments too
    return [line for line in lines if re.search(r"\b(Sender|Receiver)\(", line)]


def test_every_readme_example_opens_its_sender_and_receiver_as_context_managers() -> None:
    with open(README) as f:
        text = f.read()
    python = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    made = [line for code in python for line in _sessions_made(code)]
    assert made and all(line.lstrip().startswith("with ") or "RankedRefit(" in line for line in made), (
        made
    )  # RankedRefit owns its Sender and closes it
    assert any("with Receiver(" in line for line in made)


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


@pytest.mark.slow
def test_the_quick_start_installs_then_runs_the_demo(tmp_path) -> None:
    code = _one(lambda c: "python3 -m venv" in c and "refit demo" in c)
    steps = [s.strip() for s in code.split("&&")]
    assert steps[0] == "python3 -m venv .venv" and "pip install -e '.[demo]'" in steps
    assert steps[-1] == "refit demo"  # the install is not re-run here; the demo is
    result = _refit(steps[-1], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("all refits verified") == 2  # shm, then gloo


@pytest.mark.slow
def test_every_command_of_more_of_the_demo_runs(tmp_path) -> None:
    commands = _commands(_one(lambda c: "refit bench --quick" in c))
    assert len(commands) == 5, commands
    for line in commands:
        result = _refit(line, tmp_path)
        assert result.returncode == 0, line + "\n" + result.stdout + result.stderr[-3000:]
        if " demo " in f" {line} ":
            assert "all refits verified" in result.stdout + result.stderr, line
        if "--json" in line:
            json.loads(result.stdout)


PRELUDE = """
import json, os, sys
import torch
from refit.checks.hashes import fingerprints
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from refit.sources.fsdp import full_tensor

dist.init_process_group("gloo")
rank = dist.get_rank()
model = build_model(CONFIG, seed=0)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

def train_step():
    model(IDS, labels=IDS).loss.backward()
    opt.step()
    opt.zero_grad()
"""

FSDP_END = """
with torch.no_grad():
    live = {n: full_tensor(t) for n, t in model.state_dict(keep_vars=True).items()}
if rank == 0:
    print("LIVE " + json.dumps(fingerprints(live.items(), WIRE)), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


KEEP_ALIVE = """
sys.stdin.read()  # alive (waiting to join the engine process, say) until the engine has ended
"""


def _fill(code: str) -> str:
    """The README's placeholders: two steps, and the rendezvous handed to the engine process."""
    code = re.sub(r"for (\w+) in \.\.\.:", rf"for \1 in {STEPS}:", code)
    return code.replace("info = sender.rendezvous()", "info = hand_to_engine(sender.rendezvous())")


def _script(tmp_path, name: str, *parts: str) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / name
    path.write_text("\n".join(textwrap.dedent(p) for p in parts))
    return str(path)


def _use_halves() -> tuple[str, str]:
    code = _one(lambda c: "# engine process" in c)
    trainer, engine = code.split("# engine process")
    return _fill(trainer), engine


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


@pytest.mark.slow
def test_the_use_example_refits_an_engine_process_to_the_trainers_live_weights(tmp_path) -> None:
    trainer, engine = _use_halves()
    t = _script(tmp_path, "trainer.py", PRELUDE, TRAINER, trainer, 'report("LIVE", model)', KEEP_ALIVE)
    e = _script(tmp_path, "engine.py", PRELUDE, ENGINE, engine, 'report("HELD", hf_model)')
    _session(tmp_path, [[sys.executable, t]], e)


@pytest.mark.slow
def test_the_fsdp2_example_refits_from_two_ranks_to_the_trainers_live_weights(tmp_path) -> None:
    code = _fill(_one(lambda c: "sharded_refit" in c))
    _, engine = _use_halves()
    t = _script(tmp_path, "fsdp_trainer.py", PRELUDE, FSDP, code, FSDP_END, KEEP_ALIVE)
    e = _script(tmp_path, "engine.py", PRELUDE, ENGINE, engine, 'report("HELD", hf_model)')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    _session(tmp_path, [[sys.executable, t]] * 2, e, env_of=lambda rank: {**env, "RANK": str(rank)})


def test_the_readme_says_the_fingerprint_compares_in_the_wire_dtype_for_every_wire_dtype() -> None:
    with open(README) as f:
        text = " ".join(f.read().split())
    assert "trainer's live tensor cast to its wire dtype" in text  # the quick start's demo
    use = text[text.index('`Sender(..., verify="fingerprint")`') :][:1500]
    for case in ("cast to that wire dtype", "trainer's own", "wider", "narrower", "rounded to bf16", "slice"):
        assert case in use, case
