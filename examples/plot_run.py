"""Reward, train-inference mismatch and tokens/s against step, from the JSON
log of examples/grpo_train.py (--log-json), into a PNG. Several logs are
drawn on the same axes (e.g. one per learning rate), labelled by file name
or by --labels.

    python examples/plot_run.py run.json run.png
    python examples/plot_run.py a.json b.json --labels "lr 1e-4" "lr 3e-4" --png both.png
"""
from __future__ import annotations

import json
import os

from rollout_engine.script_args import ScriptParser


def plot(runs: dict[str, list[dict]], out: str, title: str = "GRPO") -> None:
    """runs: label -> the rows of one run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for label, rows in runs.items():
        steps = [r["step"] for r in rows]
        line, = axes[0].plot(steps, [r["reward_mean"] for r in rows], marker=".", label=label)
        color = line.get_color()
        axes[1].semilogy(steps, [max(r["mismatch_mean"], 1e-12) for r in rows], color=color,
                         label=f"{label}: mean")
        axes[1].semilogy(steps, [max(r["mismatch_max"], 1e-12) for r in rows], color=color, linestyle=":",
                         label=f"{label}: max")
        if all("mismatch_free_mean" in r for r in rows):  # --routing-replay: the same forward without replay
            axes[1].semilogy(steps, [max(r["mismatch_free_mean"], 1e-12) for r in rows], color=color,
                             linestyle="--", label=f"{label}: mean without routing replay")
        axes[2].plot(steps, [r.get("output_tokens_per_s", 0) for r in rows], color=color, marker=".")
    axes[0].set_ylabel("mean reward")
    axes[0].legend()
    axes[1].set_ylabel("|engine - trainer| logprob")
    long_labels = max(len(label) for label in runs) > 24
    axes[1].legend(fontsize="small", ncol=1 if long_labels else 2)  # two columns of long labels spill out
    axes[2].set_ylabel("output tok/s")
    axes[2].set_xlabel("step")
    axes[2].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = ScriptParser("plot_run.py", __doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="JSON lists written by grpo_train.py --log-json, then the PNG to write (unless --png)")
    p.add_argument("--png", help="the picture to write")
    p.add_argument("--labels", nargs="+", help="one per log (default: the file names)")
    p.add_argument("--title", default="GRPO")
    args = p.parse_args(argv)
    logs, png = args.files, args.png
    if png is None:
        if len(logs) < 2 or not logs[-1].endswith(".png"):
            p.error("give the PNG to write last, ending in .png, or as --png")
        logs, png = logs[:-1], logs[-1]
    if not png.endswith(".png"):
        p.error(f"--png: {png!r} does not end in .png")
    if not os.path.isdir(os.path.dirname(os.path.abspath(png))):
        p.error(f"the folder of {png!r} does not exist")
    if args.labels is not None and len(args.labels) != len(logs):
        p.error(f"--labels: {len(args.labels)} labels for {len(logs)} logs")
    labels = args.labels
    if labels is None:  # file names, or whole paths where two logs share a name
        names = [os.path.basename(log) for log in logs]
        labels = names if len(set(names)) == len(names) else list(logs)
    if len(set(labels)) != len(labels):
        p.error("each log needs its own label (--labels, or logs at different paths)")
    runs = {}
    for label, log in zip(labels, logs):
        try:
            with open(log) as f:
                rows = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            p.error(f"{log}: {e}")
        if not isinstance(rows, list) or not rows:
            p.error(f"{log} holds no steps")
        missing = {"step", "reward_mean", "mismatch_mean", "mismatch_max"} - set(rows[0]) if isinstance(rows[0], dict) \
            else {"step"}
        if missing:
            p.error(f"{log} is not a grpo_train.py --log-json log (no {', '.join(sorted(missing))})")
        runs[label] = rows
    plot(runs, png, args.title)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
