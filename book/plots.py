"""Plotting helpers shared by the chapters (one definition, imported by each).

Every chapter draws attention weights the same way: a heatmap with the query
tokens down the side, the key tokens along the top, and one fixed colour
scale from 0 to 1 so that two heatmaps can be compared by eye.
"""

import matplotlib.pyplot as plt
import numpy as np


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
    weights = np.asarray(weights, dtype=float)
    if weights.ndim != 2:
        raise ValueError(
            f"weights must be a 2-D matrix (queries x keys), got shape {weights.shape}"
        )
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
