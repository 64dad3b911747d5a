"""Which target layers the DSpark drafter reads (contract C1, fixed by the lead)."""

TAP_LAYERS = (3, 15, 27)
