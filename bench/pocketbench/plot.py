"""PNG plot of aggregate decode throughput against the number of concurrent sequences."""

from __future__ import annotations

from pathlib import Path

from pocketbench.results import BenchResults


def plot_batch_scaling(results: BenchResults, concurrency: tuple[int, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label in results.engines:
        points = [(n, s) for n in concurrency if (s := results.summary(f"batch{n}_tok_s", label)) is not None]
        if not points:
            continue
        xs = [n for n, _ in points]
        medians = [s.median for _, s in points]
        spread = [[s.median - s.min for _, s in points], [s.max - s.median for _, s in points]]
        ax.errorbar(xs, medians, yerr=spread, marker="o", capsize=3, label=label)
    meta = results.meta
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(concurrency), [str(n) for n in concurrency])
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("aggregate tok/s (median, min-max bars)")
    sizes = meta["sizes"]
    ax.set_title(f"{meta['model']}, {sizes['prompt_tokens']} in + {sizes['new_tokens']} out per sequence, "
                 f"{meta['threads']} threads, {meta['machine']}, {meta['date']}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
