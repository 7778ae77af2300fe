/* Decode only the pixels a crop needs from a JPEG, bit for bit as a whole-image decode.

   Why our own binding: simplejpeg, OpenCV and PIL decode every pixel of an image, while a
   RandomResizedCrop keeps about half of them on average. libjpeg-turbo can stop after the
   last row a crop needs, skip the inverse DCT, upsampling and colour conversion of the rows
   above it (jpeg_skip_scanlines) and of the columns beside it (jpeg_crop_scanline); none of
   those libraries exposes that. Measured on the benchmark's 128-256 px JPEGs (2-core
   machine): a whole decode 154 us, the crop 116 us, pixels identical to simplejpeg's in
   60,000 random crops; the Loader's fast path +13-15% samples/s.

   The output must equal `simplejpeg.decode_jpeg(data, "RGB")[top:top+height,
   left:left+width]` exactly, or this function must decline (return False) so that the
   caller takes that path instead. Hence:
   - only 3-component YCbCr, sequential Huffman-coded images with the chroma subsamplings
     4:4:4, 4:2:2 and 4:2:0 are taken, decoded with simplejpeg's settings (accurate integer
     IDCT, fancy upsampling, RGB); anything else declines;
   - one pixel more than asked is decoded on each side where the image has it: a pixel at
     the edge of a cropped region has no neighbour to upsample its chroma from, and differs;
   - any libjpeg warning (damaged data in what was decoded) or error declines, and the image
     goes the way it always went. The data after the last row needed is not decoded, but it
     is scanned for what would stop a whole decode: it must hold no marker other than restart
     markers in sequence, and end with the EOI marker (a truncated file: PIL, the fallback,
     refuses those). Entropy-coded data damaged only after the crop's rows, and otherwise
     intact, gives the crop's pixels, as the whole-image decode of it does (it reads it without
     a warning, or leniently where simplejpeg warns).
   The GIL is released while decoding. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#ifndef LIBJPEG_TURBO_VERSION_NUMBER
#error "shardloader.transforms._jpegcrop needs libjpeg-turbo (other libjpegs decode other pixels)"
#endif

/* Rows decoded per call (libjpeg hands out at most an iMCU row's worth). */
#define BLOCK 16
/* Columns `out` must have room for beyond the crop's: the pixel of context on each side, and
   up to 15 on the left where libjpeg moves the region's edge to an iMCU boundary (16 pixels at
   most for the subsamplings taken). */
#define EXTRA_COLUMNS 18

struct guard {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
};

static void on_error(j_common_ptr cinfo) {
    longjmp(((struct guard *)cinfo->err)->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) {
        cinfo->err->num_warnings++; /* counted, never printed */
    }
}

static int eligible(const struct jpeg_decompress_struct *c, int height, int width) {
    if ((int)c->image_height != height || (int)c->image_width != width) return 0;
    if (c->num_components != 3 || c->jpeg_color_space != JCS_YCbCr) return 0;
    if (c->progressive_mode || c->arith_code) return 0;
    const jpeg_component_info *comp = c->comp_info;
    for (int i = 1; i < 3; i++) {
        if (comp[i].h_samp_factor != 1 || comp[i].v_samp_factor != 1) return 0;
    }
    int h = comp[0].h_samp_factor, v = comp[0].v_samp_factor;
    return (h == 1 && v == 1) || (h == 2 && v == 1) || (h == 2 && v == 2);
}

/* Whether the bytes [p, end) left after the rows decoded hold only entropy-coded data: every
   0xFF is a stuffed 0xFF00, a fill byte, or a restart marker continuing the sequence of the
   previous one. A whole decode would stop at any other marker (or warn at a restart out of
   sequence); those images are left to it. `end` is where the final EOI marker starts. */
static int rest_is_clean(const unsigned char *p, const unsigned char *end, int marker) {
    int last_restart = -1;
    if (marker != 0) { /* a marker libjpeg met reading ahead, not yet processed */
        if (marker == 0xD9) return p == end + 2; /* only if it is the final one */
        if (marker < 0xD0 || marker > 0xD7) return 0;
        last_restart = marker - 0xD0;
    }
    while (p < end) {
        const unsigned char *ff = memchr(p, 0xFF, (size_t)(end - p));
        if (ff == NULL) return 1;
        if (ff + 1 >= end) return 1; /* a fill byte right before the EOI marker */
        unsigned char next = ff[1];
        if (next == 0x00) {
            p = ff + 2;
        } else if (next == 0xFF) {
            p = ff + 1;
        } else if (next >= 0xD0 && next <= 0xD7) {
            int n = next - 0xD0;
            if (last_restart >= 0 && n != (last_restart + 1) % 8) return 0;
            last_restart = n;
            p = ff + 2;
        } else {
            return 0;
        }
    }
    return 1;
}

/* 1: `out` holds the crop's rows, each `*stride` bytes apart, pixel (0, 0) at `*offset`;
   0: declined (`out` may hold anything). `out` has room for height rows of width +
   EXTRA_COLUMNS pixels. Runs without the GIL. */
static int decode_crop(const unsigned char *data, size_t size, int image_height, int image_width,
                       int top, int left, int height, int width, unsigned char *out,
                       size_t *offset, size_t *stride) {
    struct jpeg_decompress_struct c;
    struct guard err;
    volatile int done = 0;

    if (size < 4 || data[size - 2] != 0xFF || data[size - 1] != 0xD9) return 0;
    c.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&c);
        return 0;
    }
    jpeg_create_decompress(&c);
    jpeg_mem_src(&c, data, (unsigned long)size);
    if (jpeg_read_header(&c, TRUE) != JPEG_HEADER_OK || !eligible(&c, image_height, image_width)) {
        goto finish;
    }
    c.out_color_space = JCS_RGB;
    c.dct_method = JDCT_ISLOW;
    c.do_fancy_upsampling = TRUE;
    c.scale_num = c.scale_denom = 1;
    jpeg_start_decompress(&c);
    if ((int)c.output_width != image_width || (int)c.output_height != image_height ||
        c.output_components != 3) {
        goto finish;
    }
    /* One pixel of context on each side; libjpeg moves the left edge to an iMCU boundary. */
    int first = left > 0 ? left - 1 : 0;
    int end = left + width < image_width ? left + width + 1 : image_width;
    JDIMENSION xoffset = (JDIMENSION)first, cropped = (JDIMENSION)(end - first);
    if (first > 0 || end < image_width) {
        jpeg_crop_scanline(&c, &xoffset, &cropped);
    }
    if ((int)xoffset > left || (int)(xoffset + cropped) < left + width ||
        c.output_width != cropped || (int)cropped > width + EXTRA_COLUMNS) {
        goto finish;
    }
    /* The decoded rows go straight into `out`, `cropped` pixels each: the caller views the
       crop inside them (no copy). */
    *stride = (size_t)cropped * 3;
    *offset = (size_t)(left - (int)xoffset) * 3;
    if (top > 0 && jpeg_skip_scanlines(&c, (JDIMENSION)top) != (JDIMENSION)top) goto finish;
    for (int y = 0; y < height;) {
        JSAMPROW rows[BLOCK];
        int want = height - y < BLOCK ? height - y : BLOCK;
        for (int k = 0; k < want; k++) rows[k] = out + (size_t)(y + k) * *stride;
        int got = (int)jpeg_read_scanlines(&c, rows, (JDIMENSION)want);
        if (got <= 0) goto finish;
        y += got;
    }
    const unsigned char *at = c.src->next_input_byte;
    done = err.pub.num_warnings == 0 && at >= data && at <= data + size &&
           rest_is_clean(at, data + size - 2, c.unread_marker);
finish:
    jpeg_destroy_decompress(&c); /* also ends a decode stopped before its last row */
    return done;
}

PyDoc_STRVAR(decode_crop_doc,
"decode_crop(data, image_height, image_width, top, left, height, width, out)\n"
"    -> (offset, stride) | None\n\n"
"Decode the RGB pixels [top:top+height, left:left+width] of the JPEG `data` (whose header\n"
"says image_height x image_width) into `out`, a writable C-contiguous buffer of at least\n"
"height * (width + EXTRA_COLUMNS) * 3 bytes: row y of the crop starts at byte offset +\n"
"y * stride. None, `out` then undefined, when the image is not one this decoder takes or\n"
"libjpeg reports anything (the caller then decodes the whole image its usual way).");

static PyObject *py_decode_crop(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data, out;
    int image_height, image_width, top, left, height, width;
    if (!PyArg_ParseTuple(args, "y*iiiiiiw*:decode_crop", &data, &image_height, &image_width,
                          &top, &left, &height, &width, &out)) {
        return NULL;
    }
    int ok = 0;
    size_t offset = 0, stride = 0;
    if (image_height <= 0 || image_width <= 0 || height <= 0 || width <= 0 || top < 0 ||
        left < 0 || top > image_height - height || left > image_width - width) {
        PyErr_SetString(PyExc_ValueError, "decode_crop: the box is not inside the image");
    } else if (!PyBuffer_IsContiguous(&out, 'C') ||
               out.len < (Py_ssize_t)height * ((Py_ssize_t)width + EXTRA_COLUMNS) * 3) {
        PyErr_SetString(PyExc_ValueError, "decode_crop: out must be C-contiguous and hold "
                        "height * (width + EXTRA_COLUMNS) * 3 bytes");
    } else {
        Py_BEGIN_ALLOW_THREADS
        ok = decode_crop((const unsigned char *)data.buf, (size_t)data.len, image_height,
                         image_width, top, left, height, width, (unsigned char *)out.buf,
                         &offset, &stride);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (PyErr_Occurred()) return NULL;
    if (!ok) Py_RETURN_NONE;
    return Py_BuildValue("(nn)", (Py_ssize_t)offset, (Py_ssize_t)stride);
}

static PyMethodDef methods[] = {
    {"decode_crop", py_decode_crop, METH_VARARGS, decode_crop_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegcrop",
    "Crop-only JPEG decoding through libjpeg-turbo (see the C source's comment).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpegcrop(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER",
                                              LIBJPEG_TURBO_VERSION_NUMBER) < 0 ||
                      PyModule_AddIntConstant(m, "EXTRA_COLUMNS", EXTRA_COLUMNS) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
