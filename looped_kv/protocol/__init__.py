"""The pre-registration protocol: batch specs, freezing, runs, decisions, archives, self-tests, bitwise reruns."""
