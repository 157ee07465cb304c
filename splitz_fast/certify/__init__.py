"""CERTIFY and PREDICT, and what they return: the smoother (:mod:`.smoothing`, :mod:`.windows`), one input's way in
(:mod:`.inputs`), results (:mod:`.outcomes`, :mod:`.stats`), how a bound becomes a radius (:mod:`.protocols`), the
margin and sequential certifiers and the attacks."""
