"""Vision towers of the vision-language models (issue 38): CLIP and SigLIP (``clip.py``,
``siglip.py`` over the shared ViT encoder of ``vit.py``) and Qwen2.5-VL's windowed tower
(``qwen2_5_vl_vision.py``). Each maps an image's processed pixels to features; the projectors and
the decoders' splice are ``models/multimodal.py`` and the families' modules."""
