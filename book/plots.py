"""Plotting helpers shared by the chapters (one definition, imported by each).

Every chapter draws attention weights the same way: a heatmap with the query
tokens down the side, the key tokens along the top, and one fixed colour
scale from 0 to 1 so that two heatmaps can be compared by eye.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes


def plot_attention(
    weights,
    query_labels,
    key_labels,
    ax=None,
    title=None,
    annotate=True,
    colorbar=True,
):
    """Draw a matrix of attention weights as a labelled heatmap."""
    weights = check_heatmap(weights, query_labels, key_labels, ax)
    n_q, n_k = weights.shape
    if len(query_labels) != n_q or len(key_labels) != n_k:
        raise ValueError(
            f"labels do not match the weights: {len(query_labels)} query labels and "
            f"{len(key_labels)} key labels for a {n_q} x {n_k} matrix"
        )
    if ax is None:
        _, ax = plt.subplots(figsize=(1.1 * n_k + 2.2, 0.9 * n_q + 1.4))
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(n_k), labels=key_labels)
    ax.set_yticks(range(n_q), labels=query_labels)
    ax.tick_params(top=True, bottom=False, labeltop=True, labelbottom=False)
    ax.set_xlabel("key (attended to)")
    ax.xaxis.set_label_position("top")
    ax.set_ylabel("query (attending)")
    if annotate:
        for i in range(n_q):
            for j in range(n_k):
                value = weights[i, j]
                ax.text(
                    j,
                    i,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    color="black" if value > 0.6 else "white",
                    fontsize=9,
                )
    if title:
        ax.set_title(title, pad=12)
    if colorbar:
        ax.figure.colorbar(
            image, ax=ax, fraction=0.046, pad=0.04, label="attention weight"
        )
    return ax


def check_heatmap(weights, query_labels, key_labels, ax):
    """The weights as a float array; ValueError unless they are a finite,
    non-empty (queries, keys) matrix (an array or a tensor), the labels two
    lists and ax None or matplotlib Axes."""
    if hasattr(weights, "detach"):  # a torch tensor, maybe with a gradient
        weights = weights.detach().cpu().numpy()
    try:
        weights = np.asarray(weights)
        if np.iscomplexobj(weights):
            raise ValueError("complex numbers")
        weights = weights.astype(float)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"weights are not a matrix of real numbers: {e}"
        ) from None
    if weights.ndim != 2 or weights.size == 0:
        raise ValueError(
            f"weights must be a non-empty 2-D matrix (queries x keys), got "
            f"shape {weights.shape}"
        )
    if not np.isfinite(weights).all():
        raise ValueError("weights hold NaN or inf: nothing to colour")
    for name, labels in (("query", query_labels), ("key", key_labels)):
        if isinstance(labels, str) or not hasattr(labels, "__len__"):
            raise ValueError(
                f"{name}_labels must be a list of labels, got {labels!r}"
            )
    if ax is not None and not isinstance(ax, Axes):
        raise ValueError(f"ax must be matplotlib Axes or None, got {ax!r}")
    return weights
