#!/usr/bin/env python3
"""Regenerate tests/fixtures/media/ (the document and audio fixtures of src/media).

Run from the repository root:

    python3 scripts/make_media_fixtures.py

It creates a venv under target/media-venv (reportlab, Pillow, python-docx,
python-pptx, openpyxl) and re-executes itself inside it. Audio needs
`apt-get install -y espeak-ng lame`. Tests never run this script: they read
the committed files. The output is deterministic enough (reportlab's
invariant mode, fixed dates) that a re-run changes little; the zip-based
Office files carry timestamps, so they differ byte-wise.
"""

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "media")
VENV = os.path.join(ROOT, "target", "media-venv")
PACKAGES = ["reportlab", "Pillow", "python-docx", "python-pptx", "openpyxl"]

SENTENCE = "The quarterly revenue grew by twelve percent."

PROSE = [
    "Visor reads documents that a model cannot read itself and hands the model their text instead.",
    "Each page is read in order, and the words on a line are kept apart by single spaces.",
    "A page that draws a picture or a chart is marked, so that a vision model can describe it.",
    "Nothing in this paragraph matters beyond its length, which fills the page with ordinary prose.",
]


def ensure_venv():
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return
    python = os.path.join(VENV, "bin", "python")
    if not os.path.exists(python):
        subprocess.check_call([sys.executable, "-m", "venv", VENV])
    subprocess.check_call([python, "-m", "pip", "install", "-q"] + PACKAGES)
    os.execv(python, [python] + sys.argv)


def path(name):
    return os.path.join(OUT, name)


def canvas(name, **kw):
    from reportlab.lib.pagesizes import letter
    from reportlab.pdfgen import canvas as rl_canvas

    c = rl_canvas.Canvas(path(name), pagesize=letter, pageCompression=1, invariant=1, **kw)
    c.setTitle(name)
    return c


def prose_lines(c, y, lines, size=11):
    c.setFont("Helvetica", size)
    for line in lines:
        c.drawString(72, y, line)
        y -= size * 1.6
    return y


def make_text_pdf(name="text.pdf", encrypt=None):
    c = canvas(name, encrypt=encrypt)
    for page in (1, 2, 3):
        c.setFont("Helvetica-Bold", 18)
        c.drawString(72, 720, f"Annual Report, Part {page}")
        y = prose_lines(c, 690, PROSE)
        if page == 2:
            y = prose_lines(c, y - 10, [SENTENCE])
        if page == 3:
            y = prose_lines(c, y - 10, ["The last page ends the report with a short summary."])
        c.showPage()
    c.save()


def make_chart_pdf():
    from reportlab.graphics import renderPDF
    from reportlab.graphics.charts.barcharts import VerticalBarChart
    from reportlab.graphics.shapes import Drawing, String

    c = canvas("chart.pdf")
    c.setFont("Helvetica-Bold", 18)
    c.drawString(72, 720, "Sales Overview")
    prose_lines(c, 690, PROSE[:2] + ["The chart on the next page shows sales by region."])
    c.showPage()

    d = Drawing(400, 300)
    chart = VerticalBarChart()
    chart.x, chart.y, chart.width, chart.height = 50, 50, 320, 200
    chart.data = [[12, 30, 22, 41]]
    chart.categoryAxis.categoryNames = ["North", "South", "East", "West"]
    chart.valueAxis.valueMin = 0
    chart.valueAxis.valueMax = 50
    from reportlab.lib import colors

    chart.bars[0].fillColor = colors.HexColor("#3366cc")
    d.add(chart)
    d.add(String(200, 275, "Sales by Region (units)", fontName="Helvetica-Bold", fontSize=14, textAnchor="middle"))
    renderPDF.draw(d, c, 100, 380)
    c.setFont("Helvetica", 11)
    c.drawString(100, 350, "Figure 1: The West region sold the most units this year.")
    c.showPage()
    c.save()


def text_image(lines, width=1275, height=700, size=34):
    """A 1-bit raster of text lines (150 dpi, 8.5 in wide), as a scanner makes it."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("L", (width, height), 255)
    draw = ImageDraw.Draw(img)
    font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf", size)
    y = 60
    for line in lines:
        draw.text((90, y), line, font=font, fill=0)
        y += int(size * 1.7)
    return img.convert("1")


def make_scanned_pdf():
    from reportlab.lib.pagesizes import letter
    from reportlab.lib.utils import ImageReader

    img = text_image(["Scanned memo", SENTENCE, "Please file this page with the others."])
    c = canvas("scanned.pdf")
    w, h = letter
    c.drawImage(ImageReader(img), 0, h - img.height * 72 / 150, width=w, height=img.height * 72 / 150)
    c.showPage()
    c.save()


def make_many(name, pages):
    c = canvas(name)
    for n in range(1, pages + 1):
        c.setFont("Helvetica-Bold", 16)
        c.drawString(72, 720, f"Page {n}")
        y = 690
        for k in range(6):
            y = prose_lines(c, y, PROSE)
            y -= 8
        c.showPage()
    c.save()


def make_corrupt_pdf():
    with open(path("text.pdf"), "rb") as f:
        data = f.read()
    with open(path("corrupt.pdf"), "wb") as f:
        f.write(data[: len(data) // 2])


def png_picture(name, color, label):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (160, 100), color)
    ImageDraw.Draw(img).text((10, 40), label, fill="white")
    p = os.path.join(VENV, name)
    img.save(p, optimize=True)
    return p


def make_docx():
    import docx
    from docx.shared import Inches

    d = docx.Document()
    d.core_properties.author = "visor"
    d.add_heading("Quarterly Report", level=1)
    d.add_paragraph("This report covers the third quarter.")
    d.add_paragraph(SENTENCE)
    t = d.add_table(rows=3, cols=3)
    for r, row in enumerate([["Region", "Units", "Change"], ["North", "12", "+3%"], ["West", "41", "+12%"]]):
        for k, cell in enumerate(row):
            t.cell(r, k).text = cell
    d.add_paragraph("The picture below shows the team.")
    d.add_picture(png_picture("docx.png", "#2a7f62", "team photo"), width=Inches(2))
    d.add_paragraph("The report ends here.")
    d.save(path("report.docx"))


def make_pptx():
    from pptx import Presentation
    from pptx.util import Inches

    prs = Presentation()
    slides = [
        ("Roadmap", ["Ship the proxy", "Read documents"]),
        ("Results", ["Revenue grew by twelve percent", "Costs stayed flat"]),
        ("Next steps", ["Hire two engineers", "Open a second office"]),
    ]
    for i, (title, bullets) in enumerate(slides):
        s = prs.slides.add_slide(prs.slide_layouts[1])
        s.shapes.title.text = title
        body = s.placeholders[1].text_frame
        body.text = bullets[0]
        for b in bullets[1:]:
            body.add_paragraph().text = b
        if i == 1:
            s.shapes.add_picture(png_picture("pptx.png", "#cc3333", "bar chart"), Inches(6), Inches(5), width=Inches(2))
    prs.save(path("slides.pptx"))


def make_xlsx():
    import openpyxl

    wb = openpyxl.Workbook()
    ws = wb.active
    ws.title = "Sales"
    for row in [["Region", "Units", "Price"], ["North", 12, 2.5], ["West", 41, 3.25], ["North", 7, 2.5]]:
        ws.append(row)
    ws2 = wb.create_sheet("Staff")
    for row in [["Name", "Team"], ["Ada", "Platform"], ["Linus", "Kernel"]]:
        ws2.append(row)
    wb.properties.creator = "visor"
    wb.save(path("sheet.xlsx"))


def make_bombs():
    """Two small zips shaped like a DOCX whose word/document.xml unpacks to 20 MiB of zeros.

    bomb.docx declares the true size in its headers; bomb-lying.docx declares 1000 bytes, so only
    a bound on the bytes actually inflated catches it. Tests read them with a lower unpack limit.
    """
    import binascii
    import struct
    import zlib

    size = 20 << 20
    chunk = bytes(1 << 20)
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    data = b"".join(comp.compress(chunk) for _ in range(size >> 20)) + comp.flush()
    crc = 0
    for _ in range(size >> 20):
        crc = binascii.crc32(chunk, crc)
    name = b"word/document.xml"
    for out, declared in (("bomb.docx", size), ("bomb-lying.docx", 1000)):
        local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x5021, crc, len(data), declared, len(name), 0)
        central = struct.pack(
            "<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0x5021, crc, len(data), declared, len(name),
            0, 0, 0, 0, 0, 0,
        )
        end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central) + len(name), len(local) + len(name) + len(data), 0)
        with open(path(out), "wb") as f:
            f.write(local + name + data + central + name + end)


def make_audio():
    wav = path("speech.wav")
    raw = os.path.join(VENV, "speech-22k.wav")
    subprocess.check_call(["espeak-ng", "-v", "en-us", "-s", "165", "-w", raw, SENTENCE])
    # espeak-ng writes 22050 Hz mono; make the WAV 16 kHz with Python's wave module (linear resample).
    import array
    import wave

    with wave.open(raw, "rb") as r:
        rate, frames = r.getframerate(), r.readframes(r.getnframes())
    src = array.array("h", frames)
    n = int(len(src) * 16000 / rate)
    dst = array.array("h", (src[min(int(i * rate / 16000), len(src) - 1)] for i in range(n)))
    with wave.open(wav, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(dst.tobytes())
    subprocess.check_call(["lame", "--quiet", "-m", "m", "-b", "32", "--resample", "16", raw, path("speech.mp3")])


def main():
    ensure_venv()
    os.makedirs(OUT, exist_ok=True)
    make_text_pdf()
    make_text_pdf("encrypted.pdf", encrypt="secret")
    make_chart_pdf()
    make_scanned_pdf()
    make_many("long.pdf", 100)
    make_many("twenty.pdf", 20)
    make_corrupt_pdf()
    make_docx()
    make_pptx()
    make_xlsx()
    make_bombs()
    make_audio()
    for name in sorted(os.listdir(OUT)):
        print(f"{os.path.getsize(path(name)):>9}  {name}")


if __name__ == "__main__":
    main()
