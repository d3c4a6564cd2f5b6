//! The text log line, written without `core::fmt` where it can be.
//!
//! `tracing-subscriber`'s default field formatter writes every field through
//! `write!` with styled (if empty) names, and its clock through a dozen
//! padded integers. With the `request` span's bookkeeping they came to
//! 24.5k instructions for one small request's `response finished` line, a
//! sixth of what the whole request costs visor
//! (`LOG=info benches/instructions.sh`), most of it the formatting.
//! [`LogFields`] and [`LogTime`] write the same bytes directly: a string
//! that needs no escape as it is, integers by `itoa`, the time from one
//! buffer. A string that needs escapes is written by the standard
//! library's `Debug`, as the stock formatter does; a message is sanitized
//! by a copy of the stock formatter's sanitizer ([`Sanitizing`]); errors,
//! colours on a terminal and dates before 1970 or past 9999 go to
//! `tracing-subscriber`'s own code. So the line is byte for byte the one it
//! would write, which the tests below hold side by side (including the
//! sanitizer's copy). One difference is kept off by the build:
//! `tracing-subscriber`'s `tracing-log` feature (off here) would skip
//! `log.*` fields, and this formatter does not.

use std::fmt::{self, Write as _};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::{MakeVisitor, VisitFmt, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultFields, DefaultVisitor, Writer};
use tracing_subscriber::fmt::time::FormatTime;

/// Fields as `DefaultFields` writes them (`message` bare, then `name=value`
/// separated by spaces; strings in quotes, `Debug`-escaped).
#[derive(Debug, Default, Clone, Copy)]
pub struct LogFields;

impl<'a> MakeVisitor<Writer<'a>> for LogFields {
    type Visitor = FieldsVisitor<'a>;

    fn make_visitor(&self, target: Writer<'a>) -> FieldsVisitor<'a> {
        if target.has_ansi_escapes() {
            // Styled names: the stock visitor's whole way.
            return FieldsVisitor::Styled(DefaultFields::new().make_visitor(target));
        }
        FieldsVisitor::Plain {
            writer: target,
            is_empty: true,
            result: Ok(()),
        }
    }
}

/// The visitor [`LogFields`] makes.
pub enum FieldsVisitor<'a> {
    /// Colours on: `DefaultFields`' visitor.
    Styled(DefaultVisitor<'a>),
    /// Colours off: written here, the stock visitor's bytes.
    Plain {
        writer: Writer<'a>,
        is_empty: bool,
        result: fmt::Result,
    },
}

/// A string `Debug` writes between its quotes unchanged: printable ASCII
/// without `"` or `\`.
fn debug_as_is(s: &str) -> bool {
    s.bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
}

/// A message the stock visitor's ANSI sanitizing leaves unchanged: none of
/// ESC, BEL, BS, FF, DEL or a C1 control (U+0080–U+009F, `C2 80`–`C2 9F`
/// in UTF-8).
fn sanitized_as_is(s: &str) -> bool {
    let b = s.as_bytes();
    !b.iter().enumerate().any(|(i, &c)| {
        matches!(c, 0x1b | 0x07 | 0x08 | 0x0c | 0x7f)
            || (c == 0xc2 && b.get(i + 1).is_some_and(|n| (0x80..0xa0).contains(n)))
    })
}

impl FieldsVisitor<'_> {
    /// The separating space, then `name=` (a raw identifier's `r#` off).
    fn name(writer: &mut Writer<'_>, is_empty: &mut bool, field: &Field) -> fmt::Result {
        if !std::mem::take(is_empty) {
            writer.write_char(' ')?;
        }
        let name = field.name();
        writer.write_str(name.strip_prefix("r#").unwrap_or(name))?;
        writer.write_char('=')
    }

    /// One field the stock visitor writes: its way, at this place.
    fn stock(&mut self, visit: impl FnOnce(&mut DefaultVisitor<'_>)) {
        match self {
            FieldsVisitor::Styled(v) => visit(v),
            FieldsVisitor::Plain {
                writer,
                is_empty,
                result,
            } => {
                if result.is_err() {
                    return;
                }
                let mut v = DefaultVisitor::new(writer.by_ref(), *is_empty);
                visit(&mut v);
                *result = v.finish();
                *is_empty = false;
            }
        }
    }

    /// `name=` and then what `write` writes (the stock visitor's bytes for
    /// any field but `message`).
    fn plain(&mut self, field: &Field, write: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if let FieldsVisitor::Plain {
            writer,
            is_empty,
            result,
        } = self
            && result.is_ok()
        {
            *result = Self::name(writer, is_empty, field).and_then(|()| write(writer));
        }
    }

    fn integer(&mut self, field: &Field, n: impl itoa::Integer + fmt::Debug) {
        match self {
            FieldsVisitor::Plain { .. } if field.name() != "message" => {
                self.plain(field, |w| w.write_str(itoa::Buffer::new().format(n)));
            }
            _ => self.record_debug(field, &n),
        }
    }
}

impl Visit for FieldsVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        match self {
            FieldsVisitor::Styled(v) => v.record_str(field, value),
            FieldsVisitor::Plain { .. } if field.name() == "message" => {
                self.record_debug(field, &format_args!("{value}"));
            }
            FieldsVisitor::Plain { .. } if debug_as_is(value) => self.plain(field, |w| {
                w.write_char('"')?;
                w.write_str(value)?;
                w.write_char('"')
            }),
            FieldsVisitor::Plain { .. } => self.plain(field, |w| write!(w, "{value:?}")),
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.integer(field, value);
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.integer(field, value);
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        match self {
            FieldsVisitor::Plain { .. } if field.name() != "message" => {
                self.plain(field, |w| w.write_str(if value { "true" } else { "false" }));
            }
            _ => self.record_debug(field, &value),
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.stock(|v| v.record_error(field, value));
    }

    /// `message` bare (sanitized as the stock visitor does), any other
    /// field `name=` and its `Debug`.
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        match self {
            FieldsVisitor::Plain {
                writer,
                is_empty,
                result,
            } if field.name() == "message" => {
                if result.is_err() {
                    return;
                }
                if !std::mem::take(is_empty) {
                    *result = writer.write_char(' ');
                }
                let sanitize = writer.sanitizes_ansi_escapes();
                *result = result.and_then(|()| match sanitize {
                    true => write!(Sanitizing(writer), "{value:?}"),
                    false => write!(writer, "{value:?}"),
                });
            }
            FieldsVisitor::Plain { .. } => self.plain(field, |w| write!(w, "{value:?}")),
            FieldsVisitor::Styled(v) => v.record_debug(field, value),
        }
    }
}

/// A message written as the stock visitor's ANSI sanitizing writes it: a
/// piece with nothing to escape at once, any other character by character.
struct Sanitizing<'w, 'a>(&'w mut Writer<'a>);

impl fmt::Write for Sanitizing<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if sanitized_as_is(s) {
            return self.0.write_str(s);
        }
        for ch in s.chars() {
            match ch {
                '\x1b' => self.0.write_str("\\x1b")?,
                '\x07' => self.0.write_str("\\x07")?,
                '\x08' => self.0.write_str("\\x08")?,
                '\x0c' => self.0.write_str("\\x0c")?,
                '\x7f' => self.0.write_str("\\x7f")?,
                '\u{80}'..='\u{9f}' => write!(self.0, "\\u{{{:x}}}", ch as u32)?,
                _ => self.0.write_char(ch)?,
            }
        }
        Ok(())
    }
}

impl VisitOutput<fmt::Result> for FieldsVisitor<'_> {
    fn finish(self) -> fmt::Result {
        match self {
            FieldsVisitor::Styled(v) => v.finish(),
            FieldsVisitor::Plain { result, .. } => result,
        }
    }
}

impl VisitFmt for FieldsVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        match self {
            FieldsVisitor::Styled(v) => v.writer(),
            FieldsVisitor::Plain { writer, .. } => writer,
        }
    }
}

/// The time as `tracing-subscriber`'s `SystemTime` writes it
/// (`2026-11-29T21:41:09.120506Z`), from one buffer.
#[derive(Debug, Default, Clone, Copy)]
pub struct LogTime;

impl FormatTime for LogTime {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        let since = SystemTime::now().duration_since(UNIX_EPOCH).ok();
        match since.and_then(|d| rfc3339_micros(d.as_secs(), d.subsec_micros())) {
            Some(buf) => w.write_str(std::str::from_utf8(&buf).map_err(|_| fmt::Error)?),
            // Before 1970 or after 9999: the stock clock's way.
            None => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SS.uuuuuuZ` for a time after the epoch, up to the end
/// of year 9999 (`None` past it).
pub fn rfc3339_micros(secs: u64, micros: u32) -> Option<[u8; 27]> {
    let days = secs / 86_400;
    let (year, month, day) = civil_from_days(days);
    if year > 9999 {
        return None;
    }
    let of_day = secs % 86_400;
    let mut out = *b"0000-00-00T00:00:00.000000Z";
    let mut put = |at: usize, width: usize, mut n: u64| {
        for i in (at..at + width).rev() {
            out[i] = b'0' + (n % 10) as u8;
            n /= 10;
        }
    };
    put(0, 4, year);
    put(5, 2, month);
    put(8, 2, day);
    put(11, 2, of_day / 3600);
    put(14, 2, of_day / 60 % 60);
    put(17, 2, of_day % 60);
    put(20, 6, u64::from(micros.min(999_999)));
    Some(out)
}

/// The proleptic Gregorian date of a day counted from 1970-01-01
/// (Howard Hinnant's `civil_from_days`, for days after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use proptest::prelude::*;
    use tracing_subscriber::fmt::MakeWriter;

    use super::*;

    /// Lines written to memory.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::ErrorKind::Other)?
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Lines {
        type Writer = Lines;
        fn make_writer(&'a self) -> Lines {
            self.clone()
        }
    }

    impl Lines {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().map(|v| v.clone()).unwrap_or_default())
                .unwrap_or_default()
        }
    }

    /// What `emit` logs, written by the stock field formatter and by
    /// [`LogFields`], with the settings given (no time: the clock is
    /// checked on its own).
    fn both(ansi: bool, sanitize: bool, emit: impl Fn()) -> (String, String) {
        let (stock, fast) = (Lines::default(), Lines::default());
        let base = || {
            tracing_subscriber::fmt()
                .with_max_level(tracing::Level::TRACE)
                .with_target(false)
                .without_time()
                .with_ansi(ansi)
                .with_ansi_sanitization(sanitize)
        };
        tracing::subscriber::with_default(base().with_writer(stock.clone()).finish(), &emit);
        tracing::subscriber::with_default(
            base()
                .fmt_fields(LogFields)
                .with_writer(fast.clone())
                .finish(),
            &emit,
        );
        (stock.text(), fast.text())
    }

    #[derive(Debug)]
    struct Failed(&'static str, Option<Box<Failed>>);

    impl fmt::Display for Failed {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Failed {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    /// Every kind of field and message visor logs, and the awkward ones.
    fn every_kind() {
        let no_tokens: Option<u64> = None;
        tracing::info!(
            request_id = "req_754cfa5c00da038a561b7f5a3bb90f3f",
            upstream = %"mock",
            model = %String::from("gpt-4o"),
            status = 200u16,
            outcome = "complete",
            prompt_tokens = Some(12u64),
            completion_tokens = no_tokens,
            delta = -5i64,
            cached = true,
            ratio = 0.25f64,
            list = ?vec![1, 2],
            "response finished"
        );
        tracing::warn!(
            quoted = "say \"hi\" \\ back",
            lines = "one\ntwo\tthree\r",
            accents = "café 😀 ñ",
            controls = "bell\u{7} nel\u{85} esc\u{1b}[0m zero\u{0}",
            empty = "",
            apostrophe = "it's",
            "fields that need escapes"
        );
        tracing::error!(
            "a message with colours \u{1b}[31mred\u{1b}[0m, C1 \u{9b}2J, bell \u{7}, del \u{7f}, nel \u{85}"
        );
        tracing::info!("formatted {} and {:?}", 5, "quoted");
        tracing::info!(message = "a message given as a field", after = 1u64);
        tracing::info!(message = 7u64);
        tracing::info!(count = 3u64);
        tracing::info!(r#type = "raw name", "raw identifiers");
        tracing::debug!(flag = false, big = u64::MAX, small = i64::MIN, "extremes");
        tracing::info!(
            wide = u128::MAX,
            negative = i128::MIN,
            bytes = &b"\x00ab\xff"[..],
            "wide and raw"
        );
        let cause = Failed("refused", Some(Box::new(Failed("reset", None))));
        tracing::warn!(
            error = &cause as &(dyn std::error::Error + 'static),
            "with a source"
        );
        let alone = Failed("alone", None);
        tracing::warn!(error = &alone as &(dyn std::error::Error + 'static));
        tracing::warn!(
            error = &alone as &(dyn std::error::Error + 'static),
            after = 1u64
        );
        tracing::warn!(error = %cause, "as text");
        let outer = tracing::info_span!(
            "request",
            request_id = %"req_1",
            method = %"POST",
            path = %"/v1/chat/completions",
        );
        let _o = outer.enter();
        tracing::info!("inside one span");
        let inner =
            tracing::info_span!("upstream", name = "a \"b\"", later = tracing::field::Empty);
        inner.record("later", 42u64);
        let _i = inner.enter();
        let bare = tracing::info_span!("bare");
        let _b = bare.enter();
        tracing::warn!(n = 1u64, "inside three spans");
    }

    #[test]
    fn colours_off_take_the_short_way() {
        let mut s = String::new();
        // (A writer with colours is made only by the subscriber: the
        // side-by-side test below covers that way.)
        let plain = LogFields.make_visitor(Writer::new(&mut s));
        assert!(matches!(plain, FieldsVisitor::Plain { .. }));
    }

    #[test]
    fn lines_are_the_stock_formatters_byte_for_byte() {
        for (ansi, sanitize) in [(false, true), (false, false), (true, true), (true, false)] {
            let (stock, fast) = both(ansi, sanitize, every_kind);
            assert!(stock.lines().count() >= 15, "{stock}");
            assert_eq!(fast, stock, "ansi {ansi}, sanitize {sanitize}");
        }
        // The escapes were taken, and taken as the stock formatter does.
        let (stock, _) = both(false, true, every_kind);
        assert!(stock.contains(r#"quoted="say \"hi\" \\ back""#), "{stock}");
        assert!(stock.contains(r"colours \x1b[31mred"), "{stock}");
        assert!(stock.contains(r"C1 \u{9b}2J"), "{stock}");
        assert!(stock.contains(r#"request{request_id=req_1 method=POST path=/v1/chat/completions}:upstream{name="a \"b\"" later=42}:bare: "#), "{stock}");
    }

    /// Any text, with every character either formatter treats apart
    /// drawn often.
    fn text() -> impl Strategy<Value = String> {
        let apart = vec![
            '\x1b', '\x07', '\x08', '\x0c', '\x7f', '\u{80}', '\u{85}', '\u{9b}', '\u{9f}',
            '\u{a0}', '"', '\\', '\'', '\n', '\r', '\t', '\0', 'é', '\u{200b}', '\u{feff}',
        ];
        let one = prop_oneof![
            any::<char>(),
            prop::sample::select(apart),
            "[ -~]".prop_map(|s| s.chars().next().unwrap_or(' '))
        ];
        prop::collection::vec(one, 0..24).prop_map(|v| v.into_iter().collect())
    }

    proptest! {
        #[test]
        fn any_text_is_written_as_the_stock_formatter_writes_it(
            value in text(),
            message in text(),
        ) {
            for (ansi, sanitize) in [(false, true), (false, false), (true, true)] {
                let (stock, fast) = both(ansi, sanitize, || {
                    tracing::info!(value = value.as_str(), shown = %value, "{}", message);
                    tracing::info!(message = message.as_str(), value = value.as_str());
                });
                prop_assert!(stock.matches(" INFO").count() >= 2, "{}", stock);
                prop_assert_eq!(fast, stock);
            }
        }

        #[test]
        fn the_clock_writes_the_date_httpdate_does(secs in 0u64..=253_402_300_799, micros in 0u32..1_000_000) {
            let ours = rfc3339_micros(secs, micros).map(|b| String::from_utf8_lossy(&b).into_owned());
            let ours = ours.unwrap_or_default();
            // "Sun, 06 Nov 1994 08:49:37 GMT"
            let http = httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(secs));
            let p: Vec<&str> = http.split([' ', ',']).filter(|s| !s.is_empty()).collect();
            let month = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
                .iter().position(|m| *m == p[2]).map_or(0, |i| i + 1);
            let expected = format!("{}-{month:02}-{}T{}.{micros:06}Z", p[3], p[1], p[4]);
            prop_assert_eq!(ours, expected);
        }
    }

    #[test]
    fn the_clock_ends_with_year_9999_and_reads_as_the_stock_one() {
        let last = rfc3339_micros(253_402_300_799, 999_999).unwrap_or([0; 27]);
        assert_eq!(&last, b"9999-12-31T23:59:59.999999Z");
        assert_eq!(rfc3339_micros(253_402_300_800, 0), None);
        assert_eq!(
            rfc3339_micros(951_782_400, 7).map(|b| b.to_vec()),
            Some(b"2000-02-29T00:00:00.000007Z".to_vec())
        );
        // The same second as the stock clock's (read on either side of
        // ours; a second that turned between them is read again).
        let read = |t: &dyn FormatTime| {
            let mut s = String::new();
            let _ = t.format_time(&mut Writer::new(&mut s));
            s
        };
        let stock = tracing_subscriber::fmt::time::SystemTime;
        let agreed = (0..5).find_map(|_| {
            let (before, ours, after) = (read(&stock), read(&LogTime), read(&stock));
            (before[..19] == after[..19]).then_some((before, ours))
        });
        let (stock, ours) = agreed.unwrap_or_default();
        assert_eq!(ours.len(), stock.len(), "{ours} / {stock}");
        assert_eq!(ours[..19], stock[..19]);
        assert!(ours.ends_with('Z'));
    }
}
