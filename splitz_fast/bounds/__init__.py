"""The sound side: ``f_L`` over the ball ``B(x, γ)`` — pre-activation intervals and varying masks (:mod:`.intervals`),
masked operators (:mod:`.operators`) and their Gram matrices (:mod:`.gram`), the eigenvalue estimates that place a
Cholesky shift (:mod:`.eigen`) and the Cholesky certificate ``λ_max ≤ s`` (:mod:`.certificate`), certified Lipschitz
bounds (:mod:`.lipschitz`), the training estimate of the Lipschitz constant (:mod:`.estimate`, not a certificate), the
latent displacement (:mod:`.displacement`) and the γ search (:mod:`.radius`). Nothing here imports the sampling side.

``splitz_fast.bounds`` was one module before 0.2: its names are handed on here."""
from .._moved import folded_attribute
from .intervals import (
    ROUNDING_MARGIN, GAMMA_FLOOR, linear_part, affine, bias_magnitude, input_scale, first_layer_row_norms,
    squared_row_norms, masked_frobenius_sq, BallBounds, pool_interval, ball_bounds
)

__all__ = [
    "ROUNDING_MARGIN", "GAMMA_FLOOR", "linear_part", "affine", "bias_magnitude", "input_scale",
    "first_layer_row_norms", "squared_row_norms", "masked_frobenius_sq", "BallBounds", "pool_interval", "ball_bounds",
]


def __getattr__(name: str):
    """Other names of the 0.1 module ``splitz_fast.bounds``, with a warning naming their module now."""
    return folded_attribute(__name__, name)
