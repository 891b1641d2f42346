"""The tensor-parallel supervisor behind ``pocketllm-server --tensor-parallel-size 2``, and torchrun launches:
HTTP from rank 0, a clean SIGTERM, a crashed rank failing the group fast, startup failures naming the rank, and
no process left behind on any exit path (each run tags its processes' environment to find them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from pocketllm.tensor_parallel import free_port
from pocketllm.testing.checkpoints import write_checkpoint

pytest.importorskip("pocketllm_torch")

BODY = {"prompt": "the cat sat on", "temperature": 0, "max_tokens": 8}


def tagged(tag: str) -> dict[int, dict[str, str]]:
    """Live processes whose environment carries this run's tag: pid -> environment."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        if env.get("POCKETLLM_TEST_TAG") == tag and state != "Z":
            found[int(entry.name)] = env
    return found


class Launch:
    def __init__(self, command: list[str], tmp_path: Path, extra_env: dict[str, str] | None = None) -> None:
        self.tag = uuid.uuid4().hex
        self.port = free_port()
        env = os.environ | {"POCKETLLM_TEST_TAG": self.tag} | (extra_env or {})
        self.log = tmp_path / f"{self.tag}.log"
        self._out = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([*command, "--port", str(self.port)], env=env, stdout=self._out,
                                     stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log.read_text(errors="replace")

    def rank(self, rank: int) -> int:
        return next(pid for pid, env in tagged(self.tag).items()
                    if env.get("RANK") == str(rank) and "pocketllm_server" in Path(f"/proc/{pid}/cmdline").read_text())

    def finish(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._out.close()

    def assert_no_orphans(self, timeout: float = 5) -> None:
        deadline = time.monotonic() + timeout
        while tagged(self.tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not tagged(self.tag), f"left running: {sorted(tagged(self.tag))}"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_checkpoint("llama", tmp_path_factory.mktemp("tp-llama")))


def server(model: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pocketllm_server", "--model", model, "--backend", "torch", "--dtype", "float32",
            "--served-model-name", "tiny", *args]


@pytest.fixture(scope="module")
def expected(model: str) -> str:
    from pocketllm import LLM, SamplingParams

    llm = LLM(model, backend="torch", dtype="float32")
    try:
        return llm.generate(BODY["prompt"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    finally:
        llm.shutdown()


def test_the_supervisor_serves_from_rank_0_and_stops_on_sigterm(model: str, expected: str, tmp_path: Path) -> None:
    launch = Launch(server(model, "--tensor-parallel-size", "2"), tmp_path)
    try:
        launch.wait_ready()
        ranks = {env["RANK"] for env in tagged(launch.tag).values() if "RANK" in env}
        assert ranks == {"0", "1"}
        reply = httpx.post(f"{launch.url}/v1/completions", json=BODY, timeout=60).json()
        assert reply["choices"][0]["text"] == expected
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.finish() == 0, launch.output()
    finally:
        launch.proc.kill()
    launch.assert_no_orphans()


def test_a_killed_rank_fails_the_group_within_5_s(model: str, tmp_path: Path) -> None:
    launch = Launch(server(model, "--tensor-parallel-size", "2"), tmp_path)
    try:
        launch.wait_ready()
        outcome: dict[str, object] = {}

        def stream() -> None:
            try:
                with httpx.stream("POST", f"{launch.url}/v1/completions", timeout=30,
                                  json={**BODY, "max_tokens": 100000, "ignore_eos": True, "stream": True}) as r:
                    outcome["lines"] = list(r.iter_lines())
            except httpx.HTTPError as e:  # the connection closed under it: an error, not a hang
                outcome["error"] = e

        client = threading.Thread(target=stream)
        client.start()
        time.sleep(1.0)
        os.kill(launch.rank(1), signal.SIGKILL)
        killed = time.monotonic()
        code = launch.finish(timeout=10)
        assert code != 0 and time.monotonic() - killed < 5, launch.output()
        assert "rank 1 of 2 was killed by SIGKILL" in launch.output()
        client.join(timeout=10)
        assert not client.is_alive()
        assert "error" in outcome or not any(line == "data: [DONE]" for line in outcome["lines"])  # type: ignore
    finally:
        launch.proc.kill()
    launch.assert_no_orphans()


def test_a_rank_failing_at_load_is_named(model: str, tmp_path: Path) -> None:
    # Only rank 1 fails: its interpreter imports this sitecustomize, which refuses to start under RANK=1.
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\nif os.environ.get('RANK') == '1':\n    print('rank 1 cannot load: out of memory')\n"
        "    sys.stdout.flush()\n    os._exit(3)\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    launch = Launch(server(model, "--tensor-parallel-size", "2"), tmp_path, env)
    code = launch.finish(timeout=60)
    assert code != 0
    assert "rank 1 of 2 exited with code 3" in launch.output() and "cannot load: out of memory" in launch.output()
    launch.assert_no_orphans()


def test_a_readiness_timeout_stops_the_group(model: str, tmp_path: Path) -> None:
    launch = Launch(server(model, "--tensor-parallel-size", "2", "--tensor-parallel-ready-timeout", "0.2"), tmp_path)
    assert launch.finish(timeout=60) == 1
    assert "not ready after 0.2 s" in launch.output()
    launch.assert_no_orphans()


def test_killing_the_supervisor_takes_its_ranks_with_it(model: str, tmp_path: Path) -> None:
    launch = Launch(server(model, "--tensor-parallel-size", "2"), tmp_path)
    launch.wait_ready()
    launch.proc.kill()
    launch.finish()
    launch.assert_no_orphans()


def test_torchrun_launches_serve_without_the_supervisor(model: str, expected: str, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this interpreter")
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "pocketllm_server",
               "--no-tensor-parallel-supervisor", *server(model, "--tensor-parallel-size", "2")[3:]]
    launch = Launch(command, tmp_path)
    try:
        launch.wait_ready()
        reply = httpx.post(f"{launch.url}/v1/completions", json=BODY, timeout=60).json()
        assert reply["choices"][0]["text"] == expected
        launch.proc.send_signal(signal.SIGTERM)
        launch.finish()
    finally:
        launch.proc.kill()
    launch.assert_no_orphans(timeout=15)


def test_no_supervisor_without_a_launcher_is_a_clear_error(model: str) -> None:
    result = subprocess.run(server(model, "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"),
                            capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert result.returncode == 2 and "needs RANK, WORLD_SIZE" in result.stderr


def test_pocketllm_serve_is_the_server_s_command() -> None:
    result = subprocess.run([sys.executable, "-c", "import sys; from pocketllm.cli import main; "
                             "sys.exit(main(['serve', '--help']))"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "usage: pocketllm serve" in result.stdout and "--no-tensor-parallel-supervisor" in result.stdout
