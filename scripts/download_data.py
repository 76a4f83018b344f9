"""
Download the real minimind training data from the ModelScope dataset repo gongjy/minimind_dataset.

    python scripts/download_data.py                          # pretrain_hq.jsonl (~1.6 GB) + sft_mini_512.jsonl
    python scripts/download_data.py --files sft_512.jsonl --out_dir dataset

The endpoint is --endpoint, else $MODELSCOPE_ENDPOINT, else $MODELSCOPE_DOMAIN, else www.modelscope.cn
(the modelscope client's own order). It is probed with a short TCP connect first, so on a machine
without internet the script stops within seconds with exit code 2 and says how else to get data.
"""
import argparse
import os
import socket
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

DATASET_REPO = "gongjy/minimind_dataset"
DEFAULT_FILES = ["pretrain_hq.jsonl", "sft_mini_512.jsonl"]
DEFAULT_ENDPOINT = "https://www.modelscope.cn"
EXIT_OFFLINE = 2


def configured_endpoint(explicit=None):
    """The endpoint the user chose (flag or environment), or None for the modelscope default."""
    endpoint = explicit or os.environ.get("MODELSCOPE_ENDPOINT") or os.environ.get("MODELSCOPE_DOMAIN", "").strip()
    if not endpoint:
        return None
    return endpoint if "://" in endpoint else f"https://{endpoint}"


def host_and_port(endpoint: str):
    url = urlsplit(endpoint)
    return url.hostname, url.port or (443 if url.scheme == "https" else 80)


def unreachable_reason(host: str, port: int, timeout_s: float):
    """None if a TCP connection to host:port opens within timeout_s, else why it did not."""
    outcome = {}

    def connect():
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome["error"] = None
        except OSError as error:
            outcome["error"] = error

    # The DNS lookup inside create_connection ignores the timeout and can hang offline: bound it with a thread.
    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout_s)
    if "error" not in outcome:
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    if outcome["error"] is not None:
        return f"cannot connect to {host}:{port}: {outcome['error']}"
    return None


def download(files, out_dir: Path, endpoint):
    """Fetch the named files of the dataset repo into out_dir; returns the names that did not arrive."""
    from modelscope.hub.snapshot_download import dataset_snapshot_download  # slow import: only when online

    out_dir.mkdir(parents=True, exist_ok=True)
    dataset_snapshot_download(dataset_id=DATASET_REPO, local_dir=str(out_dir), allow_patterns=list(files),
                              endpoint=endpoint)
    return [name for name in files if not (out_dir / name).is_file()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="file names in the dataset repo")
    parser.add_argument("--out_dir", type=Path, default=Path("dataset"))
    parser.add_argument("--endpoint", default=None, help="ModelScope endpoint URL (default: see above)")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds to wait for the reachability probe")
    args = parser.parse_args(argv)

    # Globs would match more than asked for (the repo holds >10 GB); names also let us check what arrived.
    patterned = [name for name in args.files if any(char in name for char in "*?[]/\\")]
    if patterned:
        parser.error(f"--files takes plain file names, not patterns or paths: {' '.join(patterned)}")

    endpoint = configured_endpoint(args.endpoint)
    host, port = host_and_port(endpoint or DEFAULT_ENDPOINT)
    reason = unreachable_reason(host, port, args.timeout)
    if reason is not None:
        print(f"error: ModelScope is not reachable ({reason}).\n"
              f"This machine seems to be offline. Either download {' '.join(args.files)} from "
              f"https://www.modelscope.cn/datasets/{DATASET_REPO} on a machine with internet access and copy "
              f"them into {args.out_dir}/, or make small sample data with `python scripts/make_sample_data.py`.",
              file=sys.stderr)
        return EXIT_OFFLINE

    print(f"downloading {' '.join(args.files)} from {DATASET_REPO} into {args.out_dir}/")
    missing = download(args.files, args.out_dir, endpoint)
    if missing:
        print(f"error: not in {DATASET_REPO}: {' '.join(missing)}", file=sys.stderr)
        return 1
    for name in args.files:
        print(f"{args.out_dir / name}: {(args.out_dir / name).stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
