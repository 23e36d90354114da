"""Data-parallel routing: an approximate prefix tree per worker, the routing policies, the
``radixserve router`` HTTP proxy over several servers, and the in-process client that spreads
requests over N engine processes (``serve --data-parallel-size N``)."""
