"""Drafters: what proposes the candidate tree of each step (Medusa heads, context lookup,
retrieval, EAGLE, their mix under the speculation policy) behind one contract."""
