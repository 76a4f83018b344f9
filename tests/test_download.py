"""scripts/download_data.py offline behaviour. Never touches the real network: the endpoint is a closed local port."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from scripts import download_data

REPO = Path(__file__).resolve().parent.parent
CLOSED_LOCAL_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens there


def test_offline_run_fails_fast_with_exit_code_2_and_says_what_to_do(tmp_path):
    env = {**os.environ, "MODELSCOPE_ENDPOINT": CLOSED_LOCAL_ENDPOINT}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "scripts/download_data.py", "--out_dir", str(tmp_path / "data")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert time.monotonic() - started < 10
    assert result.returncode == download_data.EXIT_OFFLINE == 2
    assert "ModelScope is not reachable (cannot connect to 127.0.0.1:9" in result.stderr
    assert "https://www.modelscope.cn/datasets/gongjy/minimind_dataset" in result.stderr
    assert "pretrain_hq.jsonl sft_mini_512.jsonl" in result.stderr
    assert "python scripts/make_sample_data.py" in result.stderr
    assert not (tmp_path / "data").exists()


def test_endpoint_precedence_follows_the_modelscope_client(monkeypatch):
    monkeypatch.delenv("MODELSCOPE_ENDPOINT", raising=False)
    monkeypatch.delenv("MODELSCOPE_DOMAIN", raising=False)
    assert download_data.configured_endpoint() is None
    monkeypatch.setenv("MODELSCOPE_DOMAIN", "modelscope.ai")
    assert download_data.configured_endpoint() == "https://modelscope.ai"
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", CLOSED_LOCAL_ENDPOINT)
    assert download_data.configured_endpoint() == CLOSED_LOCAL_ENDPOINT
    assert download_data.configured_endpoint("http://127.0.0.1:8") == "http://127.0.0.1:8"
    assert download_data.host_and_port(download_data.DEFAULT_ENDPOINT) == ("www.modelscope.cn", 443)
    assert download_data.host_and_port(CLOSED_LOCAL_ENDPOINT) == ("127.0.0.1", 9)


def test_probe_gives_up_on_a_hanging_name_lookup_within_its_timeout(monkeypatch):
    def hanging_connection(*args, **kwargs):
        time.sleep(5)
        raise socket.gaierror("name lookup gave up")  # what a hung lookup ends in, long after the probe

    monkeypatch.setattr(socket, "create_connection", hanging_connection)
    started = time.monotonic()
    reason = download_data.unreachable_reason("www.modelscope.cn", 443, timeout_s=0.3)
    assert time.monotonic() - started < 1
    assert reason == "no answer from www.modelscope.cn:443 within 0.3 s"


def test_probe_succeeds_against_a_listening_local_port():
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert download_data.unreachable_reason("127.0.0.1", server.getsockname()[1], timeout_s=3) is None


def test_file_patterns_are_refused_before_any_network_access(capsys):
    try:
        download_data.main(["--files", "*.jsonl"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "--files takes plain file names" in capsys.readouterr().err
