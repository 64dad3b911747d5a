"""Which target layers the DSpark drafter reads (its training and the runtimes agree on them)."""

TAP_LAYERS = (3, 15, 27)


def default_tap_layers(n_layer: int) -> tuple[int, ...]:
    """TAP_LAYERS (chosen for SmolLM2's 30 blocks) where they fit; for a shallower model the
    blocks at the same fractions of its depth."""
    if max(TAP_LAYERS) < n_layer:
        return TAP_LAYERS
    return tuple(sorted({max(0, round((t + 1) * n_layer / 30) - 1) for t in TAP_LAYERS}))
