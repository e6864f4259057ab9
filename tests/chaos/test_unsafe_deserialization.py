"""No unsafe deserialization: a lint over our packages, then hostile pickles at every port and file.

The lint fails on pickle-family loads, `torch.load` without `weights_only=True`, `yaml.load`,
`marshal.loads` and `eval`/`exec`. The live half starts one real `brigade serve` (Ray, router,
prefill and decode workers, HTTP and gRPC doors, embedded Redis) and sends a pickle whose
`__reduce__` would create a marker file to every port our processes listen on (the doors, the
KV TransferServer's TCPStore, the actors' own sockets; redis-server and Ray's GCS, raylet and
agents are not ours), then checks that the marker never appears and that both doors still answer.
The files we read (HiCache L3 block files, the config YAML) get the same payload.
"""
from __future__ import annotations

import ast
import json
import pickle
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from serve_process import Served, brigade_serve

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["engine", "router", "cluster", "prefill_worker", "decode_worker", "kv_transfer", "client",
            "loadtest", "benchmarks"]
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib"}
NOT_OURS = ("redis-server", "gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env", "monitor.py",
            "ray_client_server", "RuntimeEnvAgent")


# -- the lint ---------------------------------------------------------------------------------

def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def unsafe_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) for each unsafe deserializing call in `source`, import aliases resolved."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}  # local name -> module.attr it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            alias.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            alias.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        name = f"{alias.get(head, head)}.{rest}" if rest else alias.get(head, head)
        module, _, attr = name.rpartition(".")
        keywords = {k.arg: k.value for k in node.keywords}
        weights_only = keywords.get("weights_only")
        safe_torch = isinstance(weights_only, ast.Constant) and weights_only.value is True
        if (module.split(".")[0] in PICKLERS and attr in ("load", "loads", "Unpickler")) \
                or (module == "marshal" and attr in ("load", "loads")) \
                or (module == "yaml" and attr in ("load", "load_all", "unsafe_load", "full_load")) \
                or (name == "torch.load" and not safe_torch) \
                or (name in ("eval", "exec", "builtins.eval", "builtins.exec")):
            found.append((node.lineno, name))
    return found


def test_the_lint_catches_each_unsafe_call() -> None:
    bad = """
import pickle, yaml, marshal, torch
import cloudpickle as cp
from dill import loads as dl
pickle.loads(b)
cp.load(f)
dl(b)
yaml.load(s)
marshal.loads(b)
torch.load(p)
torch.load(p, weights_only=False)
eval(s)
exec(s)
"""
    assert [line for line, _ in unsafe_calls(bad)] == list(range(5, 14))
    good = "import yaml, torch, json\nyaml.safe_load(s)\ntorch.load(p, weights_only=True)\njson.loads(s)\nm.eval()\n"
    assert unsafe_calls(good) == []


def test_our_code_has_no_unsafe_deserialization() -> None:
    files = [f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 50  # the walk really saw the packages
    found = [f"{f.relative_to(ROOT)}:{line}: {call}" for f in files for line, call in unsafe_calls(f.read_text())]
    assert not found, "unsafe deserialization:\n" + "\n".join(found)


# -- hostile payloads ---------------------------------------------------------------------------

class _Bomb:
    """Unpickling this creates `marker`: evidence that someone ran pickle.loads on our bytes."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bomb") / "unpickled"


@pytest.fixture(scope="module")
def payload(marker: Path) -> bytes:
    data = pickle.dumps(_Bomb(marker))
    assert not marker.exists()
    return data


def test_the_payload_is_live(marker: Path, payload: bytes) -> None:
    """The control: unpickling it does create the marker, so its absence below means something."""
    pickle.loads(payload)  # noqa: S301 - the point of the test
    assert marker.exists()
    marker.unlink()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    flags = ["--http-port", "0", "--grpc-port", "0", "--num-blocks", "256"]
    with brigade_serve(flags, tmp_path_factory.mktemp("serve") / "serve.log") as served:
        yield served


def _ours(p: psutil.Process) -> bool:
    cmd = " ".join(p.cmdline())
    return not any(n in cmd for n in NOT_OURS)


def _listening(root_pid: int) -> list[tuple[str, str, int]]:
    """(process, ip, port) of every listening TCP socket in the server's process tree."""
    root = psutil.Process(root_pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            if _ours(p):
                argv = p.cmdline()  # the interpreter by name: a clone's long .venv path must not push
                cmd = " ".join([Path(argv[0]).name, *argv[1:]])[:60]  # "-m cluster.cli" past the cut
                out += [(cmd, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="tcp")
                        if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return out


def _tokens(served: Served) -> str:
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{served.http_base}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def _grpc_tokenize(served: Served) -> list[int]:
    import grpc
    from brigade_client.v1 import brigade_pb2 as pb

    with grpc.insecure_channel(served.grpc_target) as channel:
        call = channel.unary_unary("/brigade.v1.Brigade/Tokenize",
                                   request_serializer=pb.TokenizeRequest.SerializeToString,
                                   response_deserializer=pb.TokenizeResponse.FromString)
        return list(call(pb.TokenizeRequest(text="hello world"), timeout=30).token_ids)


def test_pickles_at_every_port_run_nothing_and_the_server_still_answers(server: Served, marker: Path,
                                                                      payload: bytes) -> None:
    before = _tokens(server), _grpc_tokenize(server)  # also warms the KV path: prefill, transfer, decode
    ports = _listening(server.proc.pid)
    procs = {cmd for cmd, _, _ in ports}
    for needed in ("cluster.cli", "ray::RouterActor", "ray::PrefillActor", "ray::DecodeActor"):
        assert any(needed in cmd for cmd in procs), f"no listening socket of {needed} in {sorted(procs)}"
    # The decode actor listens for Ray (its core worker) and for KV: the TransferServer's TCPStore.
    assert sum("ray::DecodeActor" in cmd for cmd, _, _ in ports) >= 2, ports
    http_port, grpc_port = int(server.http_base.rsplit(":", 1)[1]), int(server.grpc_target.rsplit(":", 1)[1])
    assert {http_port, grpc_port} <= {port for _, _, port in ports}
    for _, ip, port in ports:
        for data in (payload, payload * 64, len(payload).to_bytes(8, "little") + payload):
            try:
                with socket.create_connection((ip, port), timeout=5) as s:
                    s.sendall(data)
                    s.settimeout(1)
                    s.recv(4096)
            except OSError:
                pass  # a server that hangs up on garbage is doing its job
    # As bodies too: the HTTP door's JSON parser and the gRPC door's protobuf parser.
    req = urllib.request.Request(f"{server.http_base}/v1/completions", data=payload,
                                 headers={"Content-Type": "application/octet-stream"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    import grpc

    with grpc.insecure_channel(server.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as rpc_err:
            channel.unary_unary("/brigade.v1.Brigade/GenerateUnary")(payload, timeout=30)
    assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    print(f"\nsent a pickle payload to {len(ports)} listening ports of {len(procs)} processes: "
          f"{sorted((cmd.split()[0], port) for cmd, _, port in ports)}")
    assert not marker.exists(), "a pickle sent to a port was unpickled"
    assert (_tokens(server), _grpc_tokenize(server)) == before  # the doors and the KV path still work


def test_nothing_listens_on_a_wildcard_address(server: Served) -> None:
    """With gRPC on: every listening socket of the whole tree, Ray's and Redis's included."""
    root = psutil.Process(server.proc.pid)
    wild = []
    for p in [root, *root.children(recursive=True)]:
        try:
            wild += [(p.name(), c.laddr) for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.ip in ("0.0.0.0", "::", "")]
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    assert not wild, wild


def test_a_pickle_as_a_hicache_block_file_is_quarantined_unread(tmp_path: Path, marker: Path, payload: bytes) -> None:
    import torch

    from engine.hicache.disk_store import DiskStore

    h = bytes(range(32))
    (tmp_path / f"{h.hex()}.kv").write_bytes(payload)
    layout = {"dtype": "float32", "block_shape": [2, 2, 4, 2, 32]}
    store = DiskStore(tmp_path, 1 << 30, "tiny", layout, torch.float32, (2, 2, 4, 2, 32))
    try:
        assert h not in store and store.read(h) is None
        assert store.stats["quarantined"] == 1
    finally:
        store.close()
    assert not marker.exists()


@pytest.mark.parametrize("text", ["pickle", "yaml-tag"])
def test_a_hostile_config_file_is_refused_unrun(text: str, tmp_path: Path, marker: Path, payload: bytes,
                                                capsys) -> None:
    from cluster import cli

    path = tmp_path / "cluster.yaml"
    if text == "pickle":
        path.write_bytes(payload)
    else:
        path.write_text(f"router: !!python/object/apply:builtins.open ['{marker}', 'w']\n")
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--config", str(path), "--http-port", "0", "--grpc-port", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("error:")
    assert not marker.exists()


def test_a_hostile_model_directory_runs_no_code(tmp_path: Path, marker: Path, payload: bytes) -> None:
    """A checkpoint directory is data: `auto_map` with a modeling file, a pickled
    pytorch_model.bin and a chat template reaching for Python internals are all ignored or
    refused, and the safetensors weights give the same tokens as a clean copy."""
    import shutil

    from helpers import save_hf_model

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.loader import CheckpointError
    from engine.tokenizer import Tokenizer, chat_token_ids

    clean = save_hf_model("qwen3", tmp_path / "clean")
    hostile = tmp_path / "hostile"
    shutil.copytree(clean, hostile)
    config = json.loads((hostile / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (hostile / "config.json").write_text(json.dumps(config))
    (hostile / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    (hostile / "pytorch_model.bin").write_bytes(payload)
    shutil.copy(ROOT / "engine/assets/tokenizers/bpe-4k/tokenizer.json", hostile)
    (hostile / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}")}))
    with pytest.raises(Exception, match="unsafe|not safely|access"):  # jinja2's sandbox
        chat_token_ids(Tokenizer.from_dir(hostile), [{"role": "user", "content": "hi"}])

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [[5, 17, 42, 99, 3]]
    tokens = [LLMEngine(EngineConfig(model=str(d), dtype="float32", num_threads=1))
              .generate(prompt, params)[0].token_ids for d in (clean, hostile)]
    assert tokens[0] == tokens[1]

    (hostile / "model.safetensors").unlink()  # only the pickle is left: refused, not loaded
    with pytest.raises(CheckpointError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(hostile), dtype="float32", num_threads=1))
    assert not marker.exists()
