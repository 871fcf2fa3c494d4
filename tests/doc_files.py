"""Real document files made in tests: PDF (hand-written, valid), encrypted PDF, DOCX, a noisy HTML page."""

from __future__ import annotations

import io
import zipfile


def make_pdf(pages: list[str], title: str | None = None) -> bytes:
    """A valid PDF with one text line per page (Helvetica); ``title`` in its metadata."""
    objects: list[bytes] = []
    n_pages = len(pages)
    page_ids = [4 + 2 * i for i in range(n_pages)]
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % p for p in page_ids)
                   + b"] /Count %d >>" % n_pages)
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for i, text in enumerate(pages):
        escaped = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("latin-1")
        stream = b"BT /F1 12 Tf 72 720 Td (" + escaped + b") Tj ET" if text else b""
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> "
                       b">> /Contents %d 0 R >>" % (page_ids[i] + 1))
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    info = None
    if title is not None:
        objects.append(b"<< /Title (" + title.encode("latin-1") + b") >>")
        info = len(objects)
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % i + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for off in offsets:
        out.write(b"%010d 00000 n \n" % off)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R" % (len(objects) + 1)
              + (b" /Info %d 0 R" % info if info else b"") + b" >>\nstartxref\n%d\n%%%%EOF\n" % xref)
    return out.getvalue()


def encrypt_pdf(data: bytes, user_password: str = "secret") -> bytes:
    """``data`` encrypted (RC4: no extra package); an empty ``user_password`` opens without one."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    writer.encrypt(user_password=user_password, owner_password="owner", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def make_docx(paragraphs: list[tuple[str, str]], title: str | None = None) -> bytes:
    """A minimal .docx: ``(style, text)`` paragraphs (style '' for body text, e.g. 'Heading1')."""
    w = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
    body = "".join(
        "<w:p>" + (f'<w:pPr><w:pStyle w:val="{style}"/></w:pPr>' if style else "")
        + f"<w:r><w:t xml:space=\"preserve\">{text}</w:t></w:r></w:p>" for style, text in paragraphs)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("[Content_Types].xml", '<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/'
                   'package/2006/content-types"/>')
        z.writestr("word/document.xml", f'<?xml version="1.0"?><w:document xmlns:w="{w}"><w:body>{body}'
                                        "</w:body></w:document>")
        if title is not None:
            z.writestr("docProps/core.xml", '<?xml version="1.0"?><cp:coreProperties xmlns:cp="http://schemas.'
                       'openxmlformats.org/package/2006/metadata/core-properties" xmlns:dc="http://purl.org/dc/'
                       f'elements/1.1/"><dc:title>{title}</dc:title></cp:coreProperties>')
    return out.getvalue()


NOISY_HTML = """<!DOCTYPE html>
<html><head><title>Volcano Guide</title><style>body { color: red; }</style>
<script>var tracking = "do not index me";</script></head>
<body>
<nav><a href="/">Home</a> | <a href="/about">About us</a></nav>
<header>Site banner text</header>
<main>
<p>Volcanoes are openings in the crust.
   Magma rises through them.</p>
<!-- a comment that is not text -->
<h2>Eruptions</h2>
<p>An eruption releases lava, ash and gas.<br>Some are explosive.</p>
<ul><li>Effusive</li><li>Explosive</li></ul>
<div hidden>hidden text</div>
<h2>Monitoring</h2>
<p>Seismometers record small quakes before an eruption.</p>
<script>alert("inline noise")</script>
</main>
<aside>Related links</aside>
<footer>Copyright footer</footer>
</body></html>
"""
