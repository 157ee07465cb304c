"""What is certified: ``f = f_R ∘ f_L`` (:mod:`.modules`) and the snapshot that tells whether a module still computes
what it did (:mod:`.snapshot`)."""
