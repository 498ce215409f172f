//! Cron schedules evaluated in UTC: five fields (`minute hour day-of-month month day-of-week`), or six with a
//! leading seconds field (`*/10 * * * * *`) for schedules finer than a minute.
//!
//! Each field takes `*`, a number, a range `a-b`, a step `*/n` or `a-b/n`, or a comma list of those; months and
//! weekdays also take their English three-letter names (`jan`, `mon`), and weekday 7 is Sunday like 0. As in
//! Vixie cron, when both day-of-month and day-of-week are restricted a day matches if either does.

use chrono::{DateTime, Datelike, Duration, NaiveDate, TimeZone, Timelike, Utc};

/// A parsed schedule: one bit per allowed value of each field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cron {
    seconds: u64,
    minutes: u64,
    hours: u32,
    days: u32,
    months: u16,
    weekdays: u8,
    /// Day-of-month was restricted (not `*`).
    days_restricted: bool,
    /// Day-of-week was restricted (not `*`).
    weekdays_restricted: bool,
}

const MONTHS: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const WEEKDAYS: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

/// The schedules [`Cron::parse`] accepts, as one regular expression (for the OpenAPI document): single spaces
/// between fields, numbers of at most two digits within each field's range, names, ranges (wrapping when they
/// run backwards) and steps of 1 to 99.
pub static PATTERN: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let names = |ns: &[&str]| -> String {
        ns.iter()
            .map(|n| {
                n.chars()
                    .map(|c| format!("[{}{}]", c.to_ascii_uppercase(), c))
                    .collect::<String>()
            })
            .collect::<Vec<_>>()
            .join("|")
    };
    let field = |value: &str| {
        let item = format!("(\\*|({value})(-({value}))?)(/[1-9][0-9]?)?");
        format!("{item}(,{item})*")
    };
    let sec = field("[0-5]?[0-9]");
    let hour = field("[01]?[0-9]|2[0-3]");
    let dom = field("0?[1-9]|[12][0-9]|3[01]");
    let month = field(&format!("0?[1-9]|1[0-2]|{}", names(&MONTHS)));
    let dow = field(&format!("0?[0-7]|{}", names(&WEEKDAYS)));
    format!("^({sec} )?{sec} {hour} {dom} {month} {dow}$")
});

/// How far back [`Cron::previous`] looks: a schedule that matches nothing for longer than this (e.g. Feb 30) has
/// no previous fire time.
const LOOKBACK_DAYS: i64 = 366 * 5;

impl Cron {
    pub fn parse(s: &str) -> Result<Self, String> {
        let parsed = Self::parse_fields(s)?;
        static RE: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
            regex::Regex::new(&PATTERN).unwrap_or_else(|e| panic!("cron pattern: {e}"))
        });
        if !RE.is_match(s) {
            return Err(format!(
                "cron {s:?}: fields are separated by single spaces, numbers have at most two digits, steps are 1-99"
            ));
        }
        Ok(parsed)
    }

    fn parse_fields(s: &str) -> Result<Self, String> {
        let all: Vec<&str> = s.split_whitespace().collect();
        let (seconds, fields) = match all.len() {
            5 => ("0", &all[..]),
            6 => (all[0], &all[1..]),
            n => {
                return Err(format!(
                    "cron {s:?}: expected 5 fields (minute hour day-of-month month day-of-week), or 6 with seconds \
                     first, found {n}"
                ));
            }
        };
        let seconds =
            parse_field(seconds, 0, 59, &[]).map_err(|e| format!("cron {s:?}: second field: {e}"))?;
        let field = |i: usize, name: &str, lo: u32, hi: u32, names: &[&str]| {
            parse_field(fields[i], lo, hi, names).map_err(|e| format!("cron {s:?}: {name} field: {e}"))
        };
        let minutes = field(0, "minute", 0, 59, &[])?;
        let hours = field(1, "hour", 0, 23, &[])?;
        let days = field(2, "day-of-month", 1, 31, &[])?;
        let months = field(3, "month", 1, 12, &MONTHS)?;
        let mut weekdays = field(4, "day-of-week", 0, 7, &WEEKDAYS)?;
        if weekdays & (1 << 7) != 0 {
            weekdays = (weekdays & !(1 << 7)) | 1;
        }
        Ok(Self {
            seconds,
            minutes,
            hours: u32::try_from(hours).map_err(|_| "hour field out of range".to_owned())?,
            days: u32::try_from(days).map_err(|_| "day field out of range".to_owned())?,
            months: u16::try_from(months >> 1).map_err(|_| "month field out of range".to_owned())?,
            weekdays: u8::try_from(weekdays).map_err(|_| "weekday field out of range".to_owned())?,
            days_restricted: fields[2] != "*",
            weekdays_restricted: fields[4] != "*",
        })
    }

    fn day_matches(&self, d: NaiveDate) -> bool {
        if self.months & (1 << d.month0()) == 0 {
            return false;
        }
        let dom = self.days & (1 << d.day()) != 0;
        let dow = self.weekdays & (1 << d.weekday().num_days_from_sunday()) != 0;
        match (self.days_restricted, self.weekdays_restricted) {
            (true, true) => dom || dow,
            _ => dom && dow,
        }
    }

    /// The latest fire time at or before `t` (whole seconds), if there is one within five years.
    pub fn previous(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let mut day = t.date_naive();
        let mut start = Some((t.hour(), t.minute(), t.second()));
        let limit = day - Duration::days(LOOKBACK_DAYS);
        while day >= limit {
            if self.day_matches(day) {
                let (h0, m0, s0) = start.unwrap_or((23, 59, 59));
                for h in (0..=h0).rev().filter(|h| self.hours & (1 << h) != 0) {
                    let m_top = if h == h0 { m0 } else { 59 };
                    for m in (0..=m_top).rev().filter(|m| self.minutes & (1 << m) != 0) {
                        let s_top = if (h, m) == (h0, m0) { s0 } else { 59 };
                        if let Some(sec) = (0..=s_top).rev().find(|x| self.seconds & (1 << x) != 0) {
                            return Some(Utc.from_utc_datetime(&day.and_hms_opt(h, m, sec)?));
                        }
                    }
                }
            }
            start = None;
            day = day.pred_opt()?;
        }
        None
    }

    /// The first fire time strictly after `t`, if there is one within five years.
    pub fn next(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let t = t.with_nanosecond(0)? + Duration::seconds(1);
        let mut day = t.date_naive();
        let mut start = Some((t.hour(), t.minute(), t.second()));
        let limit = day + Duration::days(LOOKBACK_DAYS);
        while day <= limit {
            if self.day_matches(day) {
                let (h0, m0, s0) = start.unwrap_or((0, 0, 0));
                for h in (h0..24).filter(|h| self.hours & (1 << h) != 0) {
                    let m_bottom = if h == h0 { m0 } else { 0 };
                    for m in (m_bottom..60).filter(|m| self.minutes & (1 << m) != 0) {
                        let s_bottom = if (h, m) == (h0, m0) { s0 } else { 0 };
                        if let Some(sec) = (s_bottom..60).find(|x| self.seconds & (1 << x) != 0) {
                            return Some(Utc.from_utc_datetime(&day.and_hms_opt(h, m, sec)?));
                        }
                    }
                }
            }
            start = None;
            day = day.succ_opt()?;
        }
        None
    }
}

/// One field as a bit set over `lo..=hi`.
fn parse_field(s: &str, lo: u32, hi: u32, names: &[&str]) -> Result<u64, String> {
    let value = |v: &str| -> Result<u32, String> {
        if let Some(i) = names.iter().position(|n| n.eq_ignore_ascii_case(v)) {
            // Month names count from 1 (lo), weekday names from 0 (lo).
            return Ok(lo + u32::try_from(i).unwrap_or(0));
        }
        let n: u32 = v.parse().map_err(|_| {
            format!(
                "{v:?} is not a number{}",
                if names.is_empty() { "" } else { " or a name" }
            )
        })?;
        if n < lo || n > hi {
            return Err(format!("{n} is outside {lo}-{hi}"));
        }
        Ok(n)
    };
    let mut bits = 0u64;
    for part in s.split(',') {
        if part.is_empty() {
            return Err(format!("{s:?} has an empty list item"));
        }
        let (range, step) = match part.split_once('/') {
            Some((r, st)) => {
                let st: u32 = st.parse().map_err(|_| format!("step {st:?} is not a number"))?;
                if st == 0 {
                    return Err("a step of 0 never fires".to_owned());
                }
                if st > 99 {
                    return Err(format!("step {st} is over 99"));
                }
                (r, st)
            }
            None => (part, 1),
        };
        let (a, b) = if range == "*" {
            (lo, hi)
        } else if let Some((a, b)) = range.split_once('-') {
            (value(a)?, value(b)?)
        } else {
            let a = value(range)?;
            // `5/15` means from 5 to the end in steps of 15.
            (a, if part.contains('/') { hi } else { a })
        };
        // A range that runs backwards wraps around: `22-2` hours are 22, 23, 0, 1, 2.
        let values: Vec<u32> = if a <= b {
            (a..=b).collect()
        } else {
            (a..=hi).chain(lo..=b).collect()
        };
        for v in values.into_iter().step_by(usize::try_from(step).unwrap_or(1)) {
            bits |= 1 << v;
        }
    }
    Ok(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn every_five_minutes_fires_on_multiples_of_five() {
        let c = Cron::parse("*/5 * * * *").unwrap();
        assert_eq!(
            c.previous(at("2026-11-24T10:07:30Z")),
            Some(at("2026-11-24T10:05:00Z"))
        );
        assert_eq!(
            c.previous(at("2026-11-24T10:05:00Z")),
            Some(at("2026-11-24T10:05:00Z"))
        );
        assert_eq!(
            c.next(at("2026-11-24T10:05:00Z")),
            Some(at("2026-11-24T10:10:00Z"))
        );
        assert_eq!(
            c.next(at("2026-11-24T23:58:10Z")),
            Some(at("2026-11-25T00:00:00Z"))
        );
    }

    #[test]
    fn fields_take_ranges_lists_steps_and_names() {
        let c = Cron::parse("15,45 2-4/2 * jan-mar mon").unwrap();
        // 2026-01-05 is a Monday.
        assert_eq!(
            c.next(at("2026-01-01T00:00:00Z")),
            Some(at("2026-01-05T02:15:00Z"))
        );
        assert_eq!(
            c.next(at("2026-01-05T02:15:00Z")),
            Some(at("2026-01-05T02:45:00Z"))
        );
        assert_eq!(
            c.next(at("2026-01-05T02:45:00Z")),
            Some(at("2026-01-05T04:15:00Z"))
        );
        assert_eq!(
            c.next(at("2026-03-30T05:00:00Z")),
            Some(at("2027-01-04T02:15:00Z"))
        );
        assert_eq!(
            c.previous(at("2026-06-01T00:00:00Z")),
            Some(at("2026-03-30T04:45:00Z"))
        );
    }

    #[test]
    fn day_of_month_or_day_of_week_when_both_are_restricted() {
        // The 13th, or any Friday.
        let c = Cron::parse("0 0 13 * fri").unwrap();
        // 2026-11-20 is a Friday; 2026-12-13 a Sunday.
        assert_eq!(
            c.next(at("2026-11-14T00:00:00Z")),
            Some(at("2026-11-20T00:00:00Z"))
        );
        assert_eq!(
            c.next(at("2026-12-12T00:00:00Z")),
            Some(at("2026-12-13T00:00:00Z"))
        );
        // Only one restricted: both must hold (any day of March 2026 that is the 13th).
        let c = Cron::parse("0 0 13 3 *").unwrap();
        assert_eq!(
            c.next(at("2026-01-01T00:00:00Z")),
            Some(at("2026-03-13T00:00:00Z"))
        );
    }

    #[test]
    fn a_leading_seconds_field_fires_within_minutes() {
        let c = Cron::parse("*/10 * * * * *").unwrap();
        assert_eq!(
            c.previous(at("2026-11-24T10:07:35Z")),
            Some(at("2026-11-24T10:07:30Z"))
        );
        assert_eq!(
            c.next(at("2026-11-24T10:07:50Z")),
            Some(at("2026-11-24T10:08:00Z"))
        );
        assert_eq!(
            c.next(at("2026-11-24T10:07:51.5Z")),
            Some(at("2026-11-24T10:08:00Z"))
        );
        // Five fields fire at second 0.
        let c = Cron::parse("* * * * *").unwrap();
        assert_eq!(
            c.previous(at("2026-11-24T10:07:35Z")),
            Some(at("2026-11-24T10:07:00Z"))
        );
    }

    #[test]
    fn a_backwards_range_wraps_around() {
        let c = Cron::parse("0 22-1/2 * * *").unwrap();
        assert_eq!(
            c.next(at("2026-11-24T12:00:00Z")),
            Some(at("2026-11-24T22:00:00Z"))
        );
        assert_eq!(
            c.next(at("2026-11-24T22:00:00Z")),
            Some(at("2026-11-25T00:00:00Z"))
        );
        assert_eq!(
            c.next(at("2026-11-25T00:00:00Z")),
            Some(at("2026-11-25T22:00:00Z"))
        );
    }

    #[test]
    fn the_published_pattern_accepts_exactly_what_parses() {
        let re = regex::Regex::new(&PATTERN).unwrap();
        for s in [
            "* * * * *",
            "*/5 * * * *",
            "0 0 13 * fri",
            "15,45 2-4/2 * jan-mar mon",
            "*/10 * * * * *",
            "0 22-1/2 * * *",
            "05 00 01 01 0",
            "0 12 * * 7",
            "0 0 1 JAN,Dec Sun-Sat",
            "1-59/99 * * * *",
        ] {
            assert!(re.is_match(s), "{s}");
            Cron::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        }
        for s in [
            "",
            "* * * *",
            "* * * * * * *",
            "60 * * * *",
            "* 24 * * *",
            "* * 0 * *",
            "* * 32 * *",
            "* * * 13 *",
            "* * * * 8",
            "*/0 * * * *",
            "* * * * */100",
            "a * * * *",
            "1,,2 * * * *",
            " * * * * *",
            "* * * * * ",
            "*  * * * *",
            "\t* * * * *",
            "005 * * * *",
            "-1 * * * *",
            "1- * * * *",
            "*/ * * * *",
            "janu * * * *",
        ] {
            let parses = Cron::parse(s).is_ok() && re.is_match(s);
            assert!(!parses, "{s:?} should be refused");
        }
    }

    #[test]
    fn sunday_is_both_zero_and_seven() {
        let a = Cron::parse("0 12 * * 0").unwrap();
        let b = Cron::parse("0 12 * * 7").unwrap();
        assert_eq!(a, b);
        // 2026-11-29 is a Sunday.
        assert_eq!(
            a.next(at("2026-11-24T00:00:00Z")),
            Some(at("2026-11-29T12:00:00Z"))
        );
    }

    #[test]
    fn a_date_that_never_comes_has_no_fire_time() {
        let c = Cron::parse("0 0 30 2 *").unwrap();
        assert_eq!(c.next(at("2026-11-24T00:00:00Z")), None);
        assert_eq!(c.previous(at("2026-11-24T00:00:00Z")), None);
    }

    #[test]
    fn malformed_schedules_say_which_field_is_wrong() {
        for (s, want) in [
            ("* * * *", "expected 5 fields"),
            ("* * * * * * *", "or 6 with seconds"),
            ("61 * * * * *", "second field"),
            ("60 * * * *", "minute field: 60 is outside 0-59"),
            ("* 24 * * *", "hour field"),
            ("* * 0 * *", "day-of-month field"),
            ("* * * 13 *", "month field"),
            ("* * * * 8", "day-of-week field"),
            ("*/0 * * * *", "step of 0"),
            ("* * * * */100", "over 99"),
            ("a * * * *", "not a number"),
            ("1,,2 * * * *", "empty list item"),
        ] {
            let e = Cron::parse(s).unwrap_err();
            assert!(e.contains(want), "{s}: {e}");
        }
    }

    #[test]
    fn previous_and_next_agree_on_every_minute_of_a_day() {
        let c = Cron::parse("15 */7 1-3,22 * * *").unwrap();
        let mut t = at("2026-11-24T00:00:00Z");
        let end = at("2026-11-25T00:00:00Z");
        while t < end {
            if let Some(p) = c.previous(t) {
                assert!(p <= t);
                assert!(c.next(p).is_none_or(|n| n > t), "{t}: previous {p}");
            }
            t += Duration::seconds(37);
        }
    }
}
