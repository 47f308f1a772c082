"""PNG plots of a bench result: speedup by task and method, acceptance and
speedup against k, and where the generation time goes."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from omnidraft_mlx.bench.report import ALL, pair_name  # noqa: E402


def _rows(result: dict) -> dict[tuple[str, str], dict]:
    return {(r["task"], r["method"]): r for r in result["summary"]}


def _names(result: dict) -> tuple[list[str], list[str]]:
    tasks = list(dict.fromkeys(r["task"] for r in result["summary"]))
    methods = [m["name"] for m in result["config"]["methods"]]
    return tasks, methods


def plot_speedup(result: dict, path: Path) -> None:
    rows = _rows(result)
    tasks, methods = _names(result)
    methods = [m for m in methods if m != "plain"]
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks) * max(1, len(methods)) ** 0.5), 4))
    for j, method in enumerate(methods):
        med = np.array([rows[t, method]["speedup_median"] for t in tasks])
        iqr = np.array([rows[t, method]["speedup_iqr"] for t in tasks]).T
        x = np.arange(len(tasks)) + (j - (len(methods) - 1) / 2) * width
        ax.bar(x, med, width, label=method, yerr=[med - iqr[0], iqr[1] - med], capsize=2)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(tasks)), tasks)
    ax.set_ylabel("speedup over plain (median, IQR)")
    ax.set_title(_title(result), fontsize=9)
    ax.legend(fontsize=8, ncol=2)
    save_figure(fig, path)


def _families(methods: list[str], result: dict) -> dict[str, list[tuple[int, str]]]:
    """Methods of one kind and variant, by k: ours (text), ours (tokens), ours (omnidraft), mlx-lm."""
    families: dict[str, list[tuple[int, str]]] = {}
    for m in result["config"]["methods"]:
        if m["k"] is None or m["name"] not in methods:
            continue
        variant = m["sampling"] if result["config"].get("temp") else m["translation"]
        label = "mlx-lm" if m["kind"] == "mlxlm" else f"ours ({variant})"
        families.setdefault(label, []).append((m["k"], m["name"]))
    return families


def plot_k_sweep(result: dict, path: Path) -> None:
    rows = _rows(result)
    tasks, methods = _names(result)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, members in _families(methods, result).items():
        ks = [k for k, _ in members]
        for task in tasks:
            style = dict(marker="o", lw=2.2 if task == ALL else 1, alpha=1 if task == ALL else 0.6)
            acc = [rows[task, m]["acceptance"] for _, m in members]
            axes[0].plot(ks, [np.nan if a is None else a for a in acc], label=f"{label}, {task}", **style)
            axes[1].plot(ks, [rows[task, m]["speedup_median"] for _, m in members], **style)
    axes[0].set_ylabel("acceptance rate")
    axes[1].set_ylabel("speedup over plain (median)")
    axes[1].axhline(1.0, color="black", lw=0.8, ls="--")
    for ax in axes:
        ax.set_xlabel("draft length k")
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].legend(fontsize=7)
    fig.suptitle(_title(result), fontsize=9)
    save_figure(fig, path)


def plot_time_split(result: dict, path: Path) -> None:
    """Milliseconds per generated token, stacked: drafting, verification, the rest."""
    rows = _rows(result)
    tasks, methods = _names(result)
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 4), sharey=True, squeeze=False)
    parts = [
        ("draft_ms_per_token", "drafting"),
        ("verify_ms_per_token", "verification (target)"),
        ("other_ms_per_token", "everything else"),
    ]
    for ax, task in zip(axes[0], tasks):
        x = np.arange(len(methods))
        bottom = np.zeros(len(methods))
        for key, label in parts:
            vals = np.array([rows[task, m][key] or 0.0 for m in methods])
            ax.bar(x, vals, 0.7, bottom=bottom, label=label)
            bottom += vals
        # Methods whose time cannot be split (mlx-lm) show their total in grey.
        unsplit = np.array(
            [
                0.0 if rows[task, m]["draft_ms_per_token"] is not None else rows[task, m]["generate_ms_per_token"]
                for m in methods
            ]
        )
        ax.bar(x, unsplit, 0.7, color="grey", label="not split (mlx-lm)" if unsplit.any() else None)
        ax.set_xticks(x, methods, rotation=60, ha="right", fontsize=7)
        ax.set_title(task, fontsize=9)
    axes[0][0].set_ylabel("ms per generated token")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    save_figure(fig, path)


def plot_gamma(result: dict, path: Path) -> None:
    """The learned policy against its threshold gamma; gamma auto and the best fixed k beside it."""
    rows = _rows(result)
    tasks, _ = _names(result)
    methods = result["config"]["methods"]
    learned = sorted((m["gamma"], m["name"]) for m in methods if m["policy"] == "learned" and m["gamma"] is not None)
    auto = next((m["name"] for m in methods if m["policy"] == "learned" and m["gamma"] is None), None)
    fixed = [m["name"] for m in methods if m["kind"] == "ours" and m["policy"] == "fixed"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, task in enumerate(tasks):
        color, style = f"C{i}", dict(marker="o", lw=2.2 if task == ALL else 1)
        gammas = [g for g, _ in learned]
        axes[0].plot(gammas, [rows[task, m]["speedup_median"] for _, m in learned], color=color, label=task, **style)
        axes[1].plot(gammas, [rows[task, m]["tokens_per_forward"] for _, m in learned], color=color, **style)
        if auto:
            axes[0].axhline(rows[task, auto]["speedup_median"], color=color, ls="--", lw=1, label=f"{task}: gamma auto")
        if fixed:
            best = max(fixed, key=lambda m: rows[task, m]["speedup_median"])
            axes[0].axhline(
                rows[task, best]["speedup_median"], color=color, ls=":", lw=1, label=f"{task}: best fixed ({best})"
            )
    axes[0].set_ylabel("speedup over plain (median)")
    axes[1].set_ylabel("target tokens per target forward")
    for ax in axes:
        ax.set_xlabel("gamma (stop drafting when P(a rejection) > gamma)")
    axes[0].legend(fontsize=7)
    fig.suptitle(_title(result), fontsize=9)
    save_figure(fig, path)


def _title(result: dict) -> str:
    cfg = result["config"]
    return f"{pair_name(cfg)} ({len(cfg['prompt_ids'])} prompts, {cfg['max_tokens']} tokens, greedy)"


def save_figure(fig, path: Path) -> None:
    if not fig.get_layout_engine():
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(result: dict, out: Path) -> dict[str, Path]:
    files = {"speedup": out / "speedup.png", "k_sweep": out / "k_sweep.png", "time_split": out / "time_split.png"}
    plot_speedup(result, files["speedup"])
    plot_k_sweep(result, files["k_sweep"])
    plot_time_split(result, files["time_split"])
    if sum(m["policy"] == "learned" for m in result["config"]["methods"]) > 1:
        files["gamma"] = out / "gamma.png"
        plot_gamma(result, files["gamma"])
    return files
