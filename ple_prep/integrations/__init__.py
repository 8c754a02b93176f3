"""Bindings of the prepared table to serving stacks; they sit above everything and use the public runtime API."""
