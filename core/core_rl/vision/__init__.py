"""Vision-language models: images in data rows (:mod:`core_rl.vision.images`), prompts rendered
with image placeholders and pixel inputs (:mod:`core_rl.vision.prompts`), pixel inputs carried
row by row in a batch (:mod:`core_rl.vision.media`) and the model's kind
(:mod:`core_rl.vision.models`)."""
