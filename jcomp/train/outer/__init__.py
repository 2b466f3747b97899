"""The outer loop: islands' state and sync, delayed merges, fragments."""
