"""Decoding: the generation loop, the decode step (propose → verify → accept → commit), the
acceptance rules, sampling, tree buffers, settings and detokenizing. It calls one backend
interface (`core.backends`) and one drafter contract (`core.drafters.base`)."""
