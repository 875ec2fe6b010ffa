"""Parallel wiring: process groups, tensor-parallel collectives, engines' topology."""
