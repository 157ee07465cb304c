"""The sound side: ``f_L`` over the ball ``B(x, γ)`` — pre-activation intervals and varying masks (:mod:`.intervals`),
masked operators (:mod:`.operators`) and their Gram matrices (:mod:`.gram`), certified Lipschitz bounds
(:mod:`.lipschitz`), the latent displacement (:mod:`.displacement`) and the γ search (:mod:`.radius`). Nothing here
imports the sampling side.

``splitz_fast.bounds`` was one module before 0.2: its names are handed on here."""
from .intervals import (
    ROUNDING_MARGIN, GAMMA_FLOOR, linear_part, affine, bias_magnitude, input_scale, first_layer_row_norms,
    squared_row_norms, masked_frobenius_sq, BallBounds, pool_interval, ball_bounds
                        )

__all__ = [
    "ROUNDING_MARGIN", "GAMMA_FLOOR", "linear_part", "affine", "bias_magnitude", "input_scale",
    "first_layer_row_norms", "squared_row_norms", "masked_frobenius_sq", "BallBounds", "pool_interval", "ball_bounds",
]
