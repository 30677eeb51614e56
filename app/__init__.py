"""gridlm: the SPMD application (`python -m app DECK`)."""
