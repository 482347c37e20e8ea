"""The report's quality figure (`--objectives …,quality`): decode against the KV cache's measured KL divergence from
f16, every measured trial and the confirmed front, each front point named by its KV types: what a faster cache costs."""

from __future__ import annotations

from optuna.trial import TrialState

from fitter.report.figures import Figures, _pyplot, _save
from fitter.report.load import StudyResult
from fitter.results.measurement import speed
from fitter.results.quality_record import QUALITY, kv_of_flags

_FIGURE = "decode-vs-quality.png"


def decode_vs_quality(result: StudyResult, figs: Figures) -> None:
    if QUALITY not in result.objectives:
        return
    trials = [(float(t.user_attrs[QUALITY]["kld"]), tg, kv_of_flags(t.user_attrs.get("flags") or []))
              for t in result.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
              if isinstance(t.user_attrs.get(QUALITY), dict)
              and (tg := speed(t.user_attrs.get("measurement"), "tg")) is not None]
    front = [(float(e.quality["kld"]), tg, f"#{e.trial} {kv_of_flags(e.flags or ())}")
             for e in (result.pareto.pareto if result.pareto is not None else [])
             if e.quality is not None and (tg := e.speed("tg")) is not None]
    if not trials and not front:
        figs.notes.append("decode vs quality: skipped, no trial has its quality measured yet")
        return
    title = f"decode vs KL divergence from an f16 KV cache (llama-perplexity)\n{result.title}"
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter([k for k, _, _ in trials], [tg for _, tg, _ in trials], s=40, color="grey", alpha=0.7, label="trial")
    if front:
        ax.scatter([k for k, _, _ in front], [tg for _, tg, _ in front], s=170, marker="*", color="gold",
                   edgecolors="red", linewidths=1.2, label="Pareto front (confirm runs)", zorder=3)
        for kld, tg, label in front:
            ax.annotate(label, (kld, tg), xytext=(7, 6), textcoords="offset points", fontsize=8, color="darkred")
    ax.set_xlabel("mean KL divergence from f16 (lower: closer to the original)")
    ax.set_ylabel("decode t/s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    _save(figs, fig, _FIGURE)

    import plotly.graph_objects as go

    pf = go.Figure()
    pf.add_scatter(x=[k for k, _, _ in trials], y=[tg for _, tg, _ in trials], mode="markers", name="trial",
                   text=[kv for _, _, kv in trials], marker={"color": "grey", "size": 8})
    pf.add_scatter(x=[k for k, _, _ in front], y=[tg for _, tg, _ in front], mode="markers+text",
                   name="Pareto front (confirm runs)", text=[label for _, _, label in front],
                   textposition="top right", marker={"symbol": "star", "size": 15, "color": "gold",
                                                     "line": {"color": "red", "width": 1.5}})
    pf.update_layout(title={"text": title.replace("\n", "<br>")}, xaxis_title="mean KL divergence from f16",
                     yaxis_title="decode t/s")
    figs.html.append(("Decode vs quality", pf))
