"""The 5 M-parameter LM pair of dspark's own graph format: the speculative engine's fast test LM
(random weights in unit tests; the trained pair of tests/fixtures/toy_lm served by Triton), and
the only runtime of the draft-model methods (`draft`, `tree`)."""
