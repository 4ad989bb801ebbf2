"""``buildkit compare --plot``: size against mean KL divergence, with its 95% interval."""

from __future__ import annotations

from pathlib import Path


def plot(rows: list[dict], path: Path) -> None:
    """Size against mean KL divergence, one labelled point per row with its interval as an
    error bar (matplotlib, Agg)."""
    try:
        import matplotlib
    except ImportError:
        from buildkit.core.errors import UsageError

        raise UsageError(
            "--plot needs matplotlib: pip install 'buildkit[plot]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get("size_bytes") and r.get("kld_mean") is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in pts:
        x, y = r["size_bytes"] / 1e9, r["kld_mean"]
        ci = (r.get("ci95") or {}).get("kld_mean")
        err = [[y - ci[0]], [ci[1] - y]] if ci else None
        ax.errorbar(x, y, yerr=err, fmt="o", capsize=3)
        ax.annotate(r["variant"], (x, y), fontsize=8, textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("size (GB)")
    ax.set_ylabel("KL divergence from bf16, mean (nats), 95% interval")
    ax.set_title("size against KL divergence")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
