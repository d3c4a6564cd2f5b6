//! Small PDFs written out by hand, for hostile-input tests and benches
//! (the `src/media` unit tests and `benches/media.rs` include this file by
//! path; the integration tests use it as `support::pdf_build`).
#![allow(dead_code, clippy::unwrap_used)]

/// A PDF of `objects` (numbered from 3: 1 is the catalog, 2 the page tree)
/// and `pages` pages of `size` pt square, each drawing object 3 as its
/// content with `resources`, with a cross-reference table.
pub fn pdf(pages: usize, size: u32, resources: &str, objects: &[Vec<u8>]) -> Vec<u8> {
    let first = 3 + objects.len();
    let kids: Vec<String> = (0..pages).map(|i| format!("{} 0 R", first + i)).collect();
    let mut bodies: Vec<Vec<u8>> = vec![
        b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(),
        format!(
            "<< /Type /Pages /Kids [{}] /Count {pages} >>",
            kids.join(" ")
        )
        .into_bytes(),
    ];
    bodies.extend(objects.iter().cloned());
    for _ in 0..pages {
        bodies.push(
            format!(
                "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {size} {size}] /Contents 3 0 R /Resources << {resources} >> >>"
            )
            .into_bytes(),
        );
    }
    let mut out = b"%PDF-1.7\n".to_vec();
    let mut offsets = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        offsets.push(out.len());
        out.extend_from_slice(format!("{} 0 obj\n", i + 1).as_bytes());
        out.extend_from_slice(body);
        out.extend_from_slice(b"\nendobj\n");
    }
    let xref = out.len();
    out.extend_from_slice(
        format!("xref\n0 {}\n0000000000 65535 f \n", bodies.len() + 1).as_bytes(),
    );
    for o in offsets {
        out.extend_from_slice(format!("{o:010} 00000 n \n").as_bytes());
    }
    out.extend_from_slice(
        format!(
            "trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
            bodies.len() + 1
        )
        .as_bytes(),
    );
    out
}

/// A stream object: `dict`'s entries, its length, then `data`.
pub fn stream(dict: &str, data: &[u8]) -> Vec<u8> {
    let mut b = format!("<< {dict} /Length {} >>\nstream\n", data.len()).into_bytes();
    b.extend_from_slice(data);
    b.extend_from_slice(b"\nendstream");
    b
}

/// `data` zlib-compressed (a `/FlateDecode` stream's contents).
pub fn deflate(data: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
    z.write_all(data).unwrap();
    z.finish().unwrap()
}

/// A one-page PDF whose page sits `depth` `/Pages` nodes down the page
/// tree (each node's only kid is the next), drawing `content` with
/// Helvetica as `/F1`.
pub fn nested_pdf(depth: usize, content: &[u8]) -> Vec<u8> {
    // 1 the catalog, 2..=depth+1 the page tree nodes, then the page, then
    // its content.
    let page = depth + 2;
    let mut bodies: Vec<Vec<u8>> = vec![b"<< /Type /Catalog /Pages 2 0 R >>".to_vec()];
    for level in 0..depth {
        let me = level + 2;
        let parent = match level {
            0 => String::new(),
            _ => format!(" /Parent {} 0 R", me - 1),
        };
        bodies.push(
            format!("<< /Type /Pages /Kids [{} 0 R] /Count 1{parent} >>", me + 1).into_bytes(),
        );
    }
    bodies.push(
        format!(
            "<< /Type /Page /Parent {} 0 R /MediaBox [0 0 200 200] /Contents {} 0 R /Resources << /Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >> >> >>",
            page - 1,
            page + 1
        )
        .into_bytes(),
    );
    bodies.push(stream("", content));
    let mut out = b"%PDF-1.7\n".to_vec();
    let mut offsets = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        offsets.push(out.len());
        out.extend_from_slice(format!("{} 0 obj\n", i + 1).as_bytes());
        out.extend_from_slice(body);
        out.extend_from_slice(b"\nendobj\n");
    }
    let xref = out.len();
    out.extend_from_slice(
        format!("xref\n0 {}\n0000000000 65535 f \n", bodies.len() + 1).as_bytes(),
    );
    for o in offsets {
        out.extend_from_slice(format!("{o:010} 00000 n \n").as_bytes());
    }
    out.extend_from_slice(
        format!(
            "trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
            bodies.len() + 1
        )
        .as_bytes(),
    );
    out
}

/// A one-page PDF whose page tree nests `depth` `/Pages` nodes written
/// inside each other (direct objects, not references), the page at the
/// bottom drawing `content` with Helvetica as `/F1`.
pub fn inline_nested_pdf(depth: usize, content: &[u8]) -> Vec<u8> {
    let page = "<< /Type /Page /MediaBox [0 0 200 200] /Contents 3 0 R /Resources << /Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >> >> >>";
    let mut tree = page.to_owned();
    for _ in 0..depth {
        tree = format!("<< /Type /Pages /Kids [{tree}] /Count 1 >>");
    }
    let bodies: Vec<Vec<u8>> = vec![
        b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(),
        tree.into_bytes(),
        stream("", content),
    ];
    let mut out = b"%PDF-1.7\n".to_vec();
    let mut offsets = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        offsets.push(out.len());
        out.extend_from_slice(format!("{} 0 obj\n", i + 1).as_bytes());
        out.extend_from_slice(body);
        out.extend_from_slice(b"\nendobj\n");
    }
    let xref = out.len();
    out.extend_from_slice(
        format!("xref\n0 {}\n0000000000 65535 f \n", bodies.len() + 1).as_bytes(),
    );
    for o in offsets {
        out.extend_from_slice(format!("{o:010} 00000 n \n").as_bytes());
    }
    out.extend_from_slice(
        format!(
            "trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
            bodies.len() + 1
        )
        .as_bytes(),
    );
    out
}

/// An XLSX (not a PDF, but shared the same way) whose one sheet has
/// `cells` cells (100 to a row) each showing the one shared string: `salt`
/// then `x` up to `chars` characters. A few KB that a reader copying each
/// cell's string unpacks to `cells * chars` characters.
pub fn amplified_xlsx(chars: usize, cells: usize, salt: &str) -> Vec<u8> {
    use std::io::Write as _;
    let shared = format!(
        "{salt}{}",
        "x".repeat(chars.saturating_sub(salt.chars().count()))
    );
    let mut sheet = String::from(
        r#"<?xml version="1.0" encoding="UTF-8" standalone="yes"?><worksheet xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main"><sheetData>"#,
    );
    for row in 0..cells.div_ceil(100) {
        sheet.push_str(&format!(r#"<row r="{}">"#, row + 1));
        for _ in 0..(cells - row * 100).min(100) {
            sheet.push_str(r#"<c t="s"><v>0</v></c>"#);
        }
        sheet.push_str("</row>");
    }
    sheet.push_str("</sheetData></worksheet>");
    let parts: [(&str, String); 6] = [
        (
            "[Content_Types].xml",
            r#"<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types"><Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/><Default Extension="xml" ContentType="application/xml"/><Override PartName="/xl/workbook.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.sheet.main+xml"/><Override PartName="/xl/worksheets/sheet1.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.worksheet+xml"/><Override PartName="/xl/sharedStrings.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.sharedStrings+xml"/></Types>"#.to_owned(),
        ),
        (
            "_rels/.rels",
            r#"<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/officeDocument" Target="xl/workbook.xml"/></Relationships>"#.to_owned(),
        ),
        (
            "xl/workbook.xml",
            r#"<?xml version="1.0" encoding="UTF-8"?><workbook xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships"><sheets><sheet name="Data" sheetId="1" r:id="rId1"/></sheets></workbook>"#.to_owned(),
        ),
        (
            "xl/_rels/workbook.xml.rels",
            r#"<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/worksheet" Target="worksheets/sheet1.xml"/><Relationship Id="rId2" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/sharedStrings" Target="sharedStrings.xml"/></Relationships>"#.to_owned(),
        ),
        (
            "xl/sharedStrings.xml",
            format!(
                r#"<?xml version="1.0" encoding="UTF-8"?><sst xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" count="{cells}" uniqueCount="1"><si><t>{shared}</t></si></sst>"#
            ),
        ),
        ("xl/worksheets/sheet1.xml", sheet),
    ];
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated)
        .compression_level(Some(9));
    for (name, text) in parts {
        zip.start_file(name, options).unwrap();
        zip.write_all(text.as_bytes()).unwrap();
    }
    zip.finish().unwrap().into_inner()
}
