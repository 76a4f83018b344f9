"""What a run reports: the progress bar, metrics.jsonl (and wandb) lines, and the loss plot.

metrics.jsonl has one JSON object per logged optimizer step: step, epoch, loss, lr, tokens_per_s,
elapsed_s (training wall time, earlier runs of a resumed one included) and tokens_seen.
"""

import json
import os
import time

from tqdm import tqdm


def start_wandb(args, stage_name, out_dir):
    import wandb

    return wandb.init(project=args.wandb_project, name=f"{stage_name}-{out_dir.name}", config=vars(args))


class TrainingLog:
    """Rank 0's record of the run; on other ranks (enabled False) every call does nothing.

    `record` is called after every optimizer step: it moves the progress bar, and every
    log_interval steps (and at the last) appends a metrics line and sends it to wandb.
    """

    def __init__(self, metrics_path, desc, total_steps, progress, log_interval, start_time, wandb_run, enabled):
        self.metrics_path, self.log_interval, self.wandb_run, self.enabled = metrics_path, log_interval, wandb_run, enabled
        self.start_time = start_time
        self.last_time, self.last_tokens = start_time, progress.tokens_seen
        self.bar = tqdm(total=total_steps, initial=progress.step, disable=not enabled, dynamic_ncols=True, desc=desc)

    def record(self, progress, loss, lr, last):
        if not self.enabled:
            return
        now = time.time()
        tokens_per_s = (progress.tokens_seen - self.last_tokens) / max(now - self.last_time, 1e-9)
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self.bar.update(1)
        if progress.step % self.log_interval and not last:
            return
        line = {
            "step": progress.step, "epoch": progress.epoch, "loss": loss, "lr": lr,
            "tokens_per_s": round(tokens_per_s, 1),
            "elapsed_s": round(progress.elapsed_s + now - self.start_time, 3),
            "tokens_seen": progress.tokens_seen,
        }
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(line, step=progress.step)
        self.last_time, self.last_tokens = now, progress.tokens_seen

    def close(self):
        self.bar.close()


def truncate_metrics(metrics_path, last_step):
    """Drop lines logged after the checkpoint we resume from (they will be logged again)."""
    if not metrics_path.exists():
        return
    kept = []
    for line in metrics_path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a line cut short by the crash
    tmp = metrics_path.with_name(metrics_path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, metrics_path)


def plot_metrics(metrics_path, png_path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, loss_axis = plt.subplots(figsize=(8, 4.5))
    loss_axis.plot([r["step"] for r in records], [r["loss"] for r in records], color="tab:blue")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("loss", color="tab:blue")
    lr_axis = loss_axis.twinx()
    lr_axis.plot([r["step"] for r in records], [r["lr"] for r in records], color="tab:orange", alpha=0.5)
    lr_axis.set_ylabel("learning rate", color="tab:orange")
    loss_axis.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
