"""Build configuration beyond pyproject.toml: one optional C extension.

`shardloader.transforms._jpegcrop` decodes only the pixels a random crop needs (see its C
source). It is optional: where no C compiler or libjpeg-turbo headers are found (apt:
libjpeg62-turbo-dev on Debian, libjpeg-turbo8-dev on Ubuntu), building it fails with a
warning, the package installs without it, and `DecodeCropFlip` decodes whole images through
simplejpeg, with the same pixels.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardloader.transforms._jpegcrop",
            sources=["src/shardloader/transforms/_jpegcrop.c"],
            libraries=["jpeg"],
            optional=True,
        )
    ]
)
