"""Image input for vision-language models (plain Python, no jax): `decode` turns what a user submits (encoded bytes, a
PIL image, a numpy array) into one HxWx3 uint8 RGB array and its digest (`load_image`)."""

from jphoton.image.decode import DEFAULT_MAX_IMAGE_PIXELS, DecodedImage, load_image

__all__ = ["DEFAULT_MAX_IMAGE_PIXELS", "DecodedImage", "load_image"]
