"""The outer loop: what the training loop asks around each step (`driver`), the
islands' state and sync (`islands`), delayed merges (`delay`), fragments."""
