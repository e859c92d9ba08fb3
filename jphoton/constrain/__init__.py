"""Constrained decoding, host side (plain Python and numpy, no jax): `compiler` (llguidance matchers and token
bitmasks), `automaton` (regular constraints as token DFAs for the device tables), `json_regex` (a JSON schema as the
regex those automata are built from), `choice` (a `choice` request scored as one forced branch per option)."""
