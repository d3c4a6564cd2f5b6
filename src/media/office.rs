//! DOCX, PPTX and XLSX: the zip's XML parts read with quick-xml.
//!
//! Every part is inflated through [`Package::part`], which counts the bytes
//! actually inflated against [`Limits::max_unpacked_bytes`] (a zip's declared
//! sizes are checked first, but a lying header is caught by the count).
//! Relationship targets are resolved against the part that names them.

use std::collections::HashMap;
use std::io::{Cursor, Read};

use quick_xml::Reader;
use quick_xml::events::{BytesStart, Event};

use super::{DocKind, Document, Embedded, Limits, PageSink, ReadError, image_media_type};

/// More entries than any real Office file has; beyond this the zip is refused
/// before anything is inflated.
const MAX_ENTRIES: usize = 50_000;

/// An Office package: the zip, and what inflating it has cost so far.
struct Package<'a> {
    zip: zip::ZipArchive<Cursor<&'a [u8]>>,
    label: &'static str,
    budget: u64,
}

impl<'a> Package<'a> {
    fn open(bytes: &'a [u8], kind: DocKind, limits: &Limits) -> Result<Self, ReadError> {
        let label = kind.label();
        if bytes.starts_with(&[0xD0, 0xCF, 0x11, 0xE0]) {
            // A Compound File: what Office writes for a password-protected
            // document (or the legacy .doc/.ppt/.xls formats).
            return Err(ReadError::encrypted());
        }
        if !bytes.starts_with(b"PK") {
            return Err(ReadError::new(format!("not a {label}")));
        }
        let zip = zip::ZipArchive::new(Cursor::new(bytes))
            .map_err(|e| ReadError::damaged(format!("not a readable zip ({e})")))?;
        if zip.len() > MAX_ENTRIES {
            return Err(ReadError::damaged("too many zip entries"));
        }
        Ok(Self {
            zip,
            label,
            budget: u64::try_from(limits.max_unpacked_bytes).unwrap_or(u64::MAX),
        })
    }

    /// The part's bytes, or `None` when the zip has no such part.
    fn part(&mut self, name: &str) -> Result<Option<Vec<u8>>, ReadError> {
        let Some(index) = self.zip.index_for_name(name) else {
            return Ok(None);
        };
        let mut file = self.zip.by_index(index).map_err(|e| zip_error(&e))?;
        if file.encrypted() {
            return Err(ReadError::encrypted());
        }
        if file.size() > self.budget {
            return Err(ReadError::too_large());
        }
        let mut out = Vec::with_capacity(usize::try_from(file.size().min(1 << 20)).unwrap_or(0));
        let read = (&mut file)
            .take(self.budget.saturating_add(1))
            .read_to_end(&mut out);
        let got = out.len() as u64;
        if got > self.budget {
            return Err(ReadError::too_large());
        }
        read.map_err(|e| ReadError::damaged(format!("a zip entry cannot be inflated ({e})")))?;
        self.budget -= got;
        Ok(Some(out))
    }

    /// The part as text (XML parts are UTF-8; anything else is read lossily).
    fn xml(&mut self, name: &str) -> Result<Option<String>, ReadError> {
        Ok(self
            .part(name)?
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned()))
    }

    /// The main part, whose root element must be `root` (a DOCX read as a
    /// PPTX has a main part too, but a `document`, not a `presentation`).
    fn main_xml(&mut self, name: &str, root: &str) -> Result<String, ReadError> {
        let label = self.label;
        let not = || ReadError::new(format!("not a {label}: no {root} part"));
        let xml = self.xml(name)?.ok_or_else(not)?;
        let mut reader = Reader::from_str(&xml);
        loop {
            match reader.read_event() {
                Ok(Event::Start(e) | Event::Empty(e)) => {
                    if e.local_name().as_ref() == root {
                        break;
                    }
                    return Err(not());
                }
                Ok(Event::Eof) => return Err(not()),
                Err(e) => return Err(xml_error(name, &e)),
                Ok(_) => {}
            }
        }
        Ok(xml)
    }

    /// The relationships of `part`: id → (resolved target, type's last word).
    fn rels(&mut self, part: &str) -> Result<HashMap<String, (String, String)>, ReadError> {
        let (dir, file) = part.rsplit_once('/').unwrap_or(("", part));
        let rels_name = if dir.is_empty() {
            format!("_rels/{file}.rels")
        } else {
            format!("{dir}/_rels/{file}.rels")
        };
        let mut map = HashMap::new();
        let Some(xml) = self.xml(&rels_name)? else {
            return Ok(map);
        };
        let mut reader = Reader::from_str(&xml);
        loop {
            match reader.read_event() {
                Ok(Event::Start(e) | Event::Empty(e))
                    if e.local_name().as_ref() == "Relationship" =>
                {
                    let (Some(id), Some(target)) = (attr(&e, "Id"), attr(&e, "Target")) else {
                        continue;
                    };
                    if attr(&e, "TargetMode").as_deref() == Some("External") {
                        continue;
                    }
                    let kind = attr(&e, "Type")
                        .and_then(|t| t.rsplit('/').next().map(str::to_owned))
                        .unwrap_or_default();
                    map.insert(id, (resolve(dir, &target), kind));
                }
                Ok(Event::Eof) => break,
                Err(e) => return Err(xml_error(&rels_name, &e)),
                Ok(_) => {}
            }
        }
        Ok(map)
    }

    /// The image a relationship id names, read from the package.
    fn image(
        &mut self,
        rels: &HashMap<String, (String, String)>,
        id: &str,
    ) -> Result<Option<Embedded>, ReadError> {
        let Some((target, _)) = rels.get(id) else {
            return Ok(None);
        };
        let Some(bytes) = self.part(target)? else {
            return Ok(None);
        };
        let name = target.rsplit('/').next().unwrap_or(target).to_owned();
        let media_type = image_media_type(&name);
        Ok(Some(Embedded {
            name,
            media_type,
            bytes,
        }))
    }
}

fn zip_error(e: &zip::result::ZipError) -> ReadError {
    match e {
        zip::result::ZipError::UnsupportedArchive(what) if what.contains("assword") => {
            ReadError::encrypted()
        }
        other => ReadError::damaged(format!("zip: {other}")),
    }
}

fn xml_error(part: &str, e: &quick_xml::Error) -> ReadError {
    ReadError::damaged(format!("{part}: {e}"))
}

/// `target` relative to the folder `dir` (or absolute from the package root
/// when it starts with `/`), with `..` and `.` resolved.
fn resolve(dir: &str, target: &str) -> String {
    let mut parts: Vec<&str> = if target.starts_with('/') {
        Vec::new()
    } else {
        dir.split('/').filter(|p| !p.is_empty()).collect()
    };
    for piece in target.split('/') {
        match piece {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    parts.join("/")
}

/// An attribute's value by its local name (prefix ignored), unescaped.
fn attr(e: &BytesStart<'_>, local: &str) -> Option<String> {
    e.attributes().with_checks(false).flatten().find_map(|a| {
        (a.key.local_name().as_ref() == local).then(|| {
            a.normalized_value(quick_xml::XmlVersion::Implicit1_0)
                .map(|v| v.into_owned())
                .unwrap_or_else(|_| a.value.clone().into_owned())
        })
    })
}

/// The text of a general or character reference (`&amp;`, `&#x41;`).
fn reference(name: &str) -> Option<char> {
    match name {
        "amp" => Some('&'),
        "lt" => Some('<'),
        "gt" => Some('>'),
        "quot" => Some('"'),
        "apos" => Some('\''),
        _ => {
            let num = name.strip_prefix('#')?;
            let code = match num.strip_prefix('x').or_else(|| num.strip_prefix('X')) {
                Some(hex) => u32::from_str_radix(hex, 16).ok()?,
                None => num.parse().ok()?,
            };
            char::from_u32(code)
        }
    }
}

/// Rows of cells being gathered inside a table; nested tables are flattened
/// into the cell that holds them.
#[derive(Default)]
struct Table {
    rows: Vec<String>,
    row: Vec<String>,
    cell: String,
}

impl Table {
    fn end_cell(&mut self) {
        let cell = std::mem::take(&mut self.cell);
        self.row
            .push(cell.split_whitespace().collect::<Vec<_>>().join(" "));
    }

    fn end_row(&mut self) {
        let row = std::mem::take(&mut self.row);
        if !row.iter().all(String::is_empty) {
            self.rows.push(row.join(" | "));
        }
    }

    fn text(&self) -> String {
        self.rows.join("\n")
    }
}

/// Text being gathered for one page: paragraphs, with tables as rows.
#[derive(Default)]
struct Flow {
    text: String,
    tables: Vec<Table>,
    paragraph: String,
}

impl Flow {
    fn push_str(&mut self, s: &str) {
        self.paragraph.push_str(s);
    }

    fn push_char(&mut self, c: char) {
        self.paragraph.push(c);
    }

    fn end_paragraph(&mut self) {
        let paragraph = std::mem::take(&mut self.paragraph);
        match self.tables.last_mut() {
            Some(table) => {
                if !table.cell.is_empty() && !paragraph.is_empty() {
                    table.cell.push(' ');
                }
                table.cell.push_str(&paragraph);
            }
            None => {
                self.text.push_str(&paragraph);
                self.text.push('\n');
            }
        }
    }

    fn start_table(&mut self) {
        self.tables.push(Table::default());
    }

    fn end_cell(&mut self) {
        self.end_paragraph_if_open();
        if let Some(table) = self.tables.last_mut() {
            table.end_cell();
        }
    }

    fn end_row(&mut self) {
        if let Some(table) = self.tables.last_mut() {
            table.end_row();
        }
    }

    fn end_table(&mut self) {
        let Some(table) = self.tables.pop() else {
            return;
        };
        let text = table.text();
        match self.tables.last_mut() {
            Some(outer) => {
                if !outer.cell.is_empty() {
                    outer.cell.push(' ');
                }
                outer.cell.push_str(&text.replace('\n', " ; "));
            }
            None => {
                self.text.push_str(&text);
                self.text.push_str("\n\n");
            }
        }
    }

    fn end_paragraph_if_open(&mut self) {
        if !self.paragraph.is_empty() {
            self.end_paragraph();
        }
    }

    /// Close whatever is open and hand the page's text over.
    fn take_page(&mut self) -> String {
        self.end_paragraph_if_open();
        while !self.tables.is_empty() {
            self.end_cell();
            self.end_row();
            self.end_table();
        }
        std::mem::take(&mut self.text)
    }
}

// ---------------------------------------------------------------- DOCX

/// A DOCX's body, split into pages at the page breaks the file records:
/// `<w:br w:type="page"/>`, `<w:lastRenderedPageBreak/>` (where Word's last
/// layout broke the page) and `<w:pageBreakBefore/>`. A break on an empty
/// page is ignored, so a hard break that Word also noted counts once.
pub(crate) fn read_docx(bytes: &[u8], limits: &Limits) -> Result<Document, ReadError> {
    let mut package = Package::open(bytes, DocKind::Docx, limits)?;
    let main = main_part(&mut package, "word/document.xml")?;
    let xml = package.main_xml(&main, "document")?;
    let rels = package.rels(&main)?;
    let mut sink = PageSink::new(limits);
    let mut flow = Flow::default();
    let mut images = Vec::new();
    let mut in_text = false;
    let mut in_instr = false;
    let mut reader = Reader::from_str(&xml);

    loop {
        let event = reader.read_event().map_err(|e| xml_error(&main, &e))?;
        match event {
            Event::Start(e) => match e.local_name().as_ref() {
                "t" => in_text = true,
                "instrText" => in_instr = true,
                "tbl" => {
                    flow.end_paragraph_if_open();
                    flow.start_table();
                }
                _ => {}
            },
            Event::Empty(e) => match e.local_name().as_ref() {
                "tab" => flow.push_char('\t'),
                "br" | "cr" => {
                    if attr(&e, "type").as_deref() == Some("page") {
                        if !page_break(&mut flow, &mut images, &mut sink) {
                            break;
                        }
                    } else {
                        flow.push_char('\n');
                    }
                }
                "lastRenderedPageBreak" | "pageBreakBefore"
                    if attr(&e, "val").is_none_or(|v| v != "0" && v != "false")
                        && !page_break(&mut flow, &mut images, &mut sink) =>
                {
                    break;
                }
                "noBreakHyphen" => flow.push_char('-'),
                "blip" => {
                    if let Some(id) = attr(&e, "embed")
                        && let Some(image) = package.image(&rels, &id)?
                    {
                        images.push(image);
                    }
                }
                "imagedata" => {
                    if let Some(id) = attr(&e, "id")
                        && let Some(image) = package.image(&rels, &id)?
                    {
                        images.push(image);
                    }
                }
                _ => {}
            },
            Event::End(e) => match e.local_name().as_ref() {
                "t" => in_text = false,
                "instrText" => in_instr = false,
                "p" => flow.end_paragraph(),
                "tc" => flow.end_cell(),
                "tr" => flow.end_row(),
                "tbl" => flow.end_table(),
                _ => {}
            },
            Event::Text(t) if in_text && !in_instr => flow.push_str(&t.xml10_content()),
            Event::CData(t) if in_text && !in_instr => flow.push_str(&t.into_inner()),
            Event::GeneralRef(r) if in_text && !in_instr => {
                if let Some(c) = reference(&r.xml10_content()) {
                    flow.push_char(c);
                }
            }
            Event::Eof => {
                let text = flow.take_page();
                if (!text.trim().is_empty() || !images.is_empty() || sink.pages.is_empty())
                    && sink.wants_more()
                {
                    let look = !images.is_empty();
                    sink.push(&text, look, images);
                }
                break;
            }
            _ => {}
        }
    }
    Ok(sink.finish(DocKind::Docx))
}

/// End the page at a DOCX page break; false once no more pages are wanted.
/// The open paragraph goes on on the next page. A break on an empty page is
/// ignored.
fn page_break(flow: &mut Flow, images: &mut Vec<Embedded>, sink: &mut PageSink) -> bool {
    let carry = std::mem::take(&mut flow.paragraph);
    let text = flow.take_page();
    flow.paragraph = carry;
    if text.trim().is_empty() && images.is_empty() {
        return true;
    }
    if !sink.wants_more() {
        return false;
    }
    let taken = std::mem::take(images);
    let look = !taken.is_empty();
    sink.push(&text, look, taken);
    true
}

/// The main part named by the package's root relationships (officeDocument),
/// else the usual name.
fn main_part(package: &mut Package<'_>, usual: &str) -> Result<String, ReadError> {
    let root = package.rels("")?;
    Ok(root
        .values()
        .find(|(_, kind)| kind == "officeDocument")
        .map(|(target, _)| target.clone())
        .unwrap_or_else(|| usual.to_owned()))
}

// ---------------------------------------------------------------- PPTX

/// A PPTX's slides in the presentation's order: each slide's text frames and
/// tables in shape order, and its pictures.
pub(crate) fn read_pptx(bytes: &[u8], limits: &Limits) -> Result<Document, ReadError> {
    let mut package = Package::open(bytes, DocKind::Pptx, limits)?;
    let main = main_part(&mut package, "ppt/presentation.xml")?;
    let xml = package.main_xml(&main, "presentation")?;
    let rels = package.rels(&main)?;
    let mut slide_ids = Vec::new();
    let mut reader = Reader::from_str(&xml);
    loop {
        match reader.read_event().map_err(|e| xml_error(&main, &e))? {
            Event::Start(e) | Event::Empty(e) if e.local_name().as_ref() == "sldId" => {
                if let Some(id) = attr_rid(&e) {
                    slide_ids.push(id);
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    let mut sink = PageSink::new(limits);
    for id in slide_ids {
        let Some((part, _)) = rels.get(&id) else {
            continue;
        };
        if !sink.wants_more() {
            break;
        }
        let part = part.clone();
        let Some(slide) = package.xml(&part)? else {
            continue;
        };
        let slide_rels = package.rels(&part)?;
        let (text, images) = read_slide(&mut package, &part, &slide, &slide_rels)?;
        let look = !images.is_empty();
        sink.push(&text, look, images);
    }
    Ok(sink.finish(DocKind::Pptx))
}

/// The `r:id` attribute (the relationship), not the numeric `id`.
fn attr_rid(e: &BytesStart<'_>) -> Option<String> {
    e.attributes().with_checks(false).flatten().find_map(|a| {
        let key = a.key.as_ref();
        (key.ends_with(":id") && key != "id").then(|| a.value.clone().into_owned())
    })
}

fn read_slide(
    package: &mut Package<'_>,
    part: &str,
    xml: &str,
    rels: &HashMap<String, (String, String)>,
) -> Result<(String, Vec<Embedded>), ReadError> {
    let mut flow = Flow::default();
    let mut images = Vec::new();
    let mut in_text = false;
    let mut reader = Reader::from_str(xml);
    loop {
        match reader.read_event().map_err(|e| xml_error(part, &e))? {
            Event::Start(e) => match e.local_name().as_ref() {
                "t" => in_text = true,
                "tbl" => {
                    flow.end_paragraph_if_open();
                    flow.start_table();
                }
                _ => {}
            },
            Event::Empty(e) => match e.local_name().as_ref() {
                "br" => flow.push_char('\n'),
                "blip" => {
                    if let Some(id) = attr(&e, "embed")
                        && let Some(image) = package.image(rels, &id)?
                    {
                        images.push(image);
                    }
                }
                _ => {}
            },
            Event::End(e) => match e.local_name().as_ref() {
                "t" => in_text = false,
                "p" => flow.end_paragraph(),
                "tc" => flow.end_cell(),
                "tr" => flow.end_row(),
                "tbl" => flow.end_table(),
                // A shape's text ends: a blank line before the next shape's.
                "txBody" if flow.tables.is_empty() => flow.text.push('\n'),
                _ => {}
            },
            Event::Text(t) if in_text => flow.push_str(&t.xml10_content()),
            Event::GeneralRef(r) if in_text => {
                if let Some(c) = reference(&r.xml10_content()) {
                    flow.push_char(c);
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    Ok((flow.take_page(), images))
}

// ---------------------------------------------------------------- XLSX

/// An XLSX's sheets in the workbook's order: "Sheet: name", then each row's
/// cells joined by " | " (empty cells between filled ones kept, so columns
/// line up). Shared strings, inline strings, numbers as stored, booleans as
/// TRUE/FALSE; cached formula results are shown, not formulas.
pub(crate) fn read_xlsx(bytes: &[u8], limits: &Limits) -> Result<Document, ReadError> {
    let mut package = Package::open(bytes, DocKind::Xlsx, limits)?;
    let main = main_part(&mut package, "xl/workbook.xml")?;
    let xml = package.main_xml(&main, "workbook")?;
    let rels = package.rels(&main)?;
    let mut sheets = Vec::new();
    let mut reader = Reader::from_str(&xml);
    loop {
        match reader.read_event().map_err(|e| xml_error(&main, &e))? {
            Event::Start(e) | Event::Empty(e) if e.local_name().as_ref() == "sheet" => {
                if let Some(id) = attr_rid(&e) {
                    sheets.push((attr(&e, "name").unwrap_or_default(), id));
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    let shared_part = rels
        .values()
        .find(|(_, kind)| kind == "sharedStrings")
        .map(|(target, _)| target.clone())
        .unwrap_or_else(|| "xl/sharedStrings.xml".to_owned());
    let shared = match package.xml(&shared_part)? {
        Some(xml) => shared_strings(&shared_part, &xml, limits.max_text_bytes)?,
        None => Vec::new(),
    };
    let mut sink = PageSink::new(limits);
    for (name, id) in sheets {
        let Some((part, _)) = rels.get(&id) else {
            continue;
        };
        if !sink.wants_more() {
            break;
        }
        let part = part.clone();
        let Some(xml) = package.xml(&part)? else {
            continue;
        };
        let cap = Cap {
            bytes: limits.max_text_bytes,
            chars: sink.room_chars(),
        };
        let (text, cut) = sheet_rows(&part, &xml, &shared, cap)?;
        sink.push(&format!("Sheet: {name}\n{text}"), false, Vec::new());
        match cut {
            Some(Cut::Chars) => sink.cut_at_chars(),
            Some(Cut::Bytes) => sink.mark_truncated(),
            None => {}
        }
    }
    Ok(sink.finish(DocKind::Xlsx))
}

/// The shared strings table: each `<si>`'s text (rich runs joined, phonetic
/// runs left out). Stops gathering once `cap` bytes are held.
fn shared_strings(part: &str, xml: &str, cap: usize) -> Result<Vec<String>, ReadError> {
    let mut strings = Vec::new();
    let mut held = 0usize;
    let mut current = String::new();
    let mut in_text = false;
    let mut in_phonetic = false;
    let mut reader = Reader::from_str(xml);
    loop {
        match reader.read_event().map_err(|e| xml_error(part, &e))? {
            Event::Start(e) => match e.local_name().as_ref() {
                "t" => in_text = true,
                "rPh" => in_phonetic = true,
                _ => {}
            },
            Event::End(e) => match e.local_name().as_ref() {
                "t" => in_text = false,
                "rPh" => in_phonetic = false,
                "si" => {
                    held += current.len();
                    let s = std::mem::take(&mut current);
                    strings.push(if held > cap { String::new() } else { s });
                }
                _ => {}
            },
            Event::Empty(e) if e.local_name().as_ref() == "si" => strings.push(String::new()),
            Event::Text(t) if in_text && !in_phonetic => current.push_str(&t.xml10_content()),
            Event::GeneralRef(r) if in_text && !in_phonetic => {
                if let Some(c) = reference(&r.xml10_content()) {
                    current.push(c);
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    Ok(strings)
}

/// The 0-based column of a cell reference like `AB12`.
fn column_of(reference: &str) -> Option<usize> {
    let mut col = 0usize;
    let mut any = false;
    for c in reference.chars() {
        if c.is_ascii_alphabetic() {
            col = col
                .checked_mul(26)?
                .checked_add((c.to_ascii_uppercase() as usize) - 64)?;
            any = true;
        } else {
            break;
        }
    }
    (any && col > 0).then(|| col - 1)
}

/// Columns beyond this are not padded (Excel's own limit is 16384).
const MAX_COLUMN: usize = 16_384;

/// How much text one worksheet may still become.
#[derive(Clone, Copy)]
struct Cap {
    bytes: usize,
    chars: usize,
}

/// Why a worksheet's rows were cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// Over the byte bound: the rows after are not read.
    Bytes,
    /// Over the character budget ([`Limits::max_text_chars`]): not read
    /// further either, cell by cell (a row of 16,384 cells each showing
    /// one 10,000-character shared string is never made).
    Chars,
}

/// The rows of one worksheet, and whether (why) they were cut at `cap`.
/// Reading stops at the first cell past the character budget: a shared
/// string repeated in every cell is copied only as often as it fits.
fn sheet_rows(
    part: &str,
    xml: &str,
    shared: &[String],
    cap: Cap,
) -> Result<(String, Option<Cut>), ReadError> {
    let mut sheet = SheetText {
        shared,
        cap,
        chars: 0,
        row_chars: 0,
        out: String::new(),
        row: Vec::new(),
        cell_type: String::new(),
        cell_col: None,
        value: String::new(),
        in_value: false,
    };
    let mut reader = Reader::from_str(xml);
    loop {
        match reader.read_event().map_err(|e| xml_error(part, &e))? {
            Event::Start(e) => match e.local_name().as_ref() {
                "row" => sheet.start_row(),
                "c" => {
                    sheet.cell_type = attr(&e, "t").unwrap_or_default();
                    sheet.cell_col = attr(&e, "r").and_then(|r| column_of(&r));
                    sheet.value.clear();
                }
                "v" | "t" => sheet.in_value = true,
                _ => {}
            },
            Event::End(e) => {
                let cut = match e.local_name().as_ref() {
                    "v" | "t" => {
                        sheet.in_value = false;
                        None
                    }
                    "c" => sheet.end_cell(),
                    "row" => sheet.end_row(),
                    _ => None,
                };
                if cut.is_some() {
                    return Ok((sheet.out, cut));
                }
            }
            Event::Text(t) if sheet.in_value => sheet.value.push_str(&t.xml10_content()),
            Event::GeneralRef(r) if sheet.in_value => {
                if let Some(c) = reference(&r.xml10_content()) {
                    sheet.value.push(c);
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    Ok((sheet.out, None))
}

/// A worksheet being read into rows: the rows written, the row and the
/// cell being read.
struct SheetText<'s> {
    shared: &'s [String],
    cap: Cap,
    /// Characters held: the rows written, and the cells of the row being
    /// read (with their " | " separators).
    chars: usize,
    row_chars: usize,
    out: String,
    row: Vec<String>,
    /// The cell's `t` (type) and column.
    cell_type: String,
    cell_col: Option<usize>,
    /// Its `<v>` (or inline `<t>`) text, and whether it is being read.
    value: String,
    in_value: bool,
}

impl SheetText<'_> {
    fn start_row(&mut self) {
        self.row.clear();
        self.row_chars = 0;
    }

    /// What the cell read shows: a shared string, TRUE or FALSE, or its
    /// value.
    fn shown(&mut self) -> String {
        match self.cell_type.as_str() {
            "s" => self
                .value
                .trim()
                .parse::<usize>()
                .ok()
                .and_then(|i| self.shared.get(i).cloned())
                .unwrap_or_default(),
            "b" => match self.value.trim() {
                "1" => "TRUE".to_owned(),
                "0" => "FALSE".to_owned(),
                other => other.to_owned(),
            },
            _ => std::mem::take(&mut self.value),
        }
    }

    /// Adds the cell read to the row, at its column; past the character
    /// budget, writes the row so far, cut where the budget ends (the rest
    /// of the sheet is not read).
    fn end_cell(&mut self) -> Option<Cut> {
        let shown = self.shown();
        let col = self.cell_col.unwrap_or(self.row.len()).min(MAX_COLUMN);
        // Its separators, and its text.
        self.row_chars += 3 * (col.saturating_sub(self.row.len()) + 1);
        self.row_chars += shown.chars().count();
        if self.chars + self.row_chars > self.cap.chars {
            let room = self.cap.chars.saturating_sub(self.chars);
            let mut line = self.row.join(" | ");
            if !line.is_empty() {
                line.push_str(" | ");
            }
            line.push_str(&shown.replace(['\n', '\r'], " "));
            if let Some((at, _)) = line.char_indices().nth(room) {
                line.truncate(at);
            }
            self.out.push_str(&line);
            return Some(Cut::Chars);
        }
        while self.row.len() < col {
            self.row.push(String::new());
        }
        self.row.push(shown.replace(['\n', '\r'], " "));
        None
    }

    /// Writes the row read (without its trailing empty cells; nothing for
    /// an empty row); over the byte bound, the rows after are not read.
    fn end_row(&mut self) -> Option<Cut> {
        while self.row.last().is_some_and(String::is_empty) {
            self.row.pop();
        }
        if !self.row.is_empty() {
            let line = self.row.join(" | ");
            self.chars += line.chars().count() + 1;
            self.out.push_str(&line);
            self.out.push('\n');
        }
        self.start_row();
        (self.out.len() > self.cap.bytes).then_some(Cut::Bytes)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::super::tests::fixture;
    use super::super::{DocKind, Limits, read};
    use super::*;

    #[test]
    fn docx_text_in_order_table_as_rows_one_png() {
        let doc = read(DocKind::Docx, &fixture("report.docx"), &Limits::default()).unwrap();
        assert_eq!(doc.kind, DocKind::Docx);
        assert!(!doc.truncated);
        assert_eq!(doc.pages.len(), 1, "{doc:?}");
        let page = &doc.pages[0];
        let text = &page.text;
        let order = [
            "Quarterly Report",
            "This report covers the third quarter.",
            "The quarterly revenue grew by twelve percent.",
            "Region | Units | Change\nNorth | 12 | +3%\nWest | 41 | +12%",
            "The picture below shows the team.",
            "The report ends here.",
        ];
        let mut at = 0;
        for piece in order {
            let found = text[at..]
                .find(piece)
                .unwrap_or_else(|| panic!("{piece:?} after {at} in {text:?}"));
            at += found + piece.len();
        }
        assert_eq!(page.images.len(), 1);
        assert_eq!(page.images[0].media_type, "image/png");
        assert!(page.images[0].bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
        assert!(page.needs_look);
    }

    #[test]
    fn pptx_slides_in_order_slide_two_has_the_picture() {
        let doc = read(DocKind::Pptx, &fixture("slides.pptx"), &Limits::default()).unwrap();
        let titles = ["Roadmap", "Results", "Next steps"];
        assert_eq!(doc.pages.len(), 3);
        for (page, title) in doc.pages.iter().zip(titles) {
            assert!(page.text.starts_with(title), "{:?}", page.text);
        }
        assert!(doc.pages[0].text.contains("Ship the proxy\nRead documents"));
        assert!(doc.pages[1].text.contains("Revenue grew by twelve percent"));
        assert!(doc.pages[2].text.contains("Open a second office"));
        assert_eq!(doc.pages[1].images.len(), 1);
        assert_eq!(doc.pages[1].images[0].media_type, "image/png");
        assert!(doc.pages[1].needs_look);
        assert!(doc.pages[0].images.is_empty() && !doc.pages[0].needs_look);
        assert!(doc.pages[2].images.is_empty());
        let limited = Limits {
            max_pages: 2,
            ..Limits::default()
        };
        let doc = read(DocKind::Pptx, &fixture("slides.pptx"), &limited).unwrap();
        assert_eq!(doc.pages.len(), 2);
        assert!(doc.truncated);
    }

    #[test]
    fn xlsx_sheets_as_rows() {
        let doc = read(DocKind::Xlsx, &fixture("sheet.xlsx"), &Limits::default()).unwrap();
        assert_eq!(doc.pages.len(), 2);
        assert_eq!(
            doc.pages[0].text,
            "Sheet: Sales\nRegion | Units | Price\nNorth | 12 | 2.5\nWest | 41 | 3.25\nNorth | 7 | 2.5"
        );
        assert_eq!(
            doc.pages[1].text,
            "Sheet: Staff\nName | Team\nAda | Platform\nLinus | Kernel"
        );
        assert!(!doc.pages[0].needs_look);
    }

    #[test]
    fn an_xlsx_repeating_a_long_shared_string_is_read_only_up_to_the_text_budget() {
        // 4 KB: one 10,000-character string shown in 20,000 cells (200
        // million characters if each cell were copied out), and 200 rows
        // of 100 such cells.
        let xlsx = crate::media::pdf::pdf_build::amplified_xlsx(10_000, 20_000, "s");
        assert!(xlsx.len() < 8 << 10, "{}", xlsx.len());
        let limits = Limits {
            max_text_chars: 150_000,
            ..Limits::default()
        };
        let doc = read(DocKind::Xlsx, &xlsx, &limits).unwrap();
        let chars: usize = doc.pages.iter().map(|p| p.text.chars().count()).sum();
        assert_eq!(chars, 150_000);
        assert!(doc.truncated);
        assert_eq!(doc.stopped.as_deref(), Some(crate::media::TEXT_BUDGET));
        // The whole row is never made: cut inside it.
        let (text, cut) = sheet_rows(
            "s",
            &format!(
                "<sheetData><row>{}</row></sheetData>",
                "<c t=\"s\"><v>0</v></c>".repeat(16_384)
            ),
            &["y".repeat(10_000)],
            Cap {
                bytes: 4 << 20,
                chars: 25_000,
            },
        )
        .unwrap();
        assert_eq!(cut, Some(Cut::Chars));
        assert_eq!(text.chars().count(), 25_000);
        // Without a character budget, the byte bound (4 MiB) as before.
        let doc = read(DocKind::Xlsx, &xlsx, &Limits::default()).unwrap();
        assert!(doc.truncated);
        assert!(doc.pages[0].text.len() <= 4 << 20);
    }

    #[test]
    fn zip_bombs_are_refused() {
        let limits = Limits {
            max_unpacked_bytes: 8 << 20,
            ..Limits::default()
        };
        for name in ["bomb.docx", "bomb-lying.docx"] {
            let err = read(DocKind::Docx, &fixture(name), &limits).unwrap_err();
            assert!(
                err.reason() == "too large when unpacked" || err.reason().starts_with("damaged"),
                "{name}: {err}"
            );
        }
        // The honest one is refused from its header, before inflating.
        let err = read(DocKind::Docx, &fixture("bomb.docx"), &limits).unwrap_err();
        assert_eq!(err.reason(), "too large when unpacked");
        // Under the default limit the honest one inflates, and its zeros are not XML text.
        let doc = read(DocKind::Docx, &fixture("bomb.docx"), &Limits::default());
        assert!(doc.is_err() || doc.unwrap().pages.iter().all(|p| p.text.is_empty()));
    }

    #[test]
    fn garbage_and_wrong_kinds_are_errors() {
        for kind in [DocKind::Docx, DocKind::Pptx, DocKind::Xlsx] {
            assert!(read(kind, b"", &Limits::default()).is_err());
            assert!(read(kind, b"PK\x03\x04garbage", &Limits::default()).is_err());
            assert_eq!(
                read(
                    kind,
                    b"\xD0\xCF\x11\xE0\xA1\xB1\x1A\xE1",
                    &Limits::default()
                )
                .unwrap_err()
                .reason(),
                "encrypted"
            );
            assert!(read(kind, &fixture("text.pdf"), &Limits::default()).is_err());
        }
        // A DOCX read as a PPTX lacks its main part.
        let err = read(DocKind::Pptx, &fixture("report.docx"), &Limits::default()).unwrap_err();
        assert!(err.reason().starts_with("not a PPTX"), "{err}");
        // Half a zip has no central directory.
        let docx = fixture("report.docx");
        assert!(read(DocKind::Docx, &docx[..docx.len() / 2], &Limits::default()).is_err());
    }

    #[test]
    fn paths_resolve_against_their_part() {
        assert_eq!(
            resolve("ppt/slides", "../media/image1.png"),
            "ppt/media/image1.png"
        );
        assert_eq!(resolve("word", "media/image1.png"), "word/media/image1.png");
        assert_eq!(resolve("word", "/word/media/a.png"), "word/media/a.png");
        assert_eq!(resolve("", "word/document.xml"), "word/document.xml");
        assert_eq!(column_of("A1"), Some(0));
        assert_eq!(column_of("AB12"), Some(27));
        assert_eq!(column_of("12"), None);
        assert_eq!(reference("#x41"), Some('A'));
        assert_eq!(reference("amp"), Some('&'));
        assert_eq!(reference("nope"), None);
    }
}
