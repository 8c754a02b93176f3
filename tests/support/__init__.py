"""Helpers the tests share (not tests themselves): hand-made files, hub caches, kills, refusals, bf16 bits."""
