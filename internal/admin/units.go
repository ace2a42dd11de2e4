package admin

import (
	"fmt"
	"html/template"
	"math"
	"strconv"
	"time"
)

// The status pages show numbers in a person's units: bytes in binary
// multiples (256 MiB, not 268435456), durations rounded to what matters at
// their size (1h4m, 2.5s, 340ms), rates per second to three significant
// digits.

// HumanBytes writes n bytes in the largest binary unit that keeps the
// number at least 1, with up to one decimal: 256 MiB, 1.5 KiB, 12 B.
func HumanBytes(n int64) string {
	const units = "KMGTPE"
	if n < 1024 && n > -1024 {
		return strconv.FormatInt(n, 10) + " B"
	}
	v := float64(n)
	i := -1
	for math.Abs(v) >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	return trimZero(strconv.FormatFloat(v, 'f', 1, 64)) + " " + units[i:i+1] + "iB"
}

func trimZero(s string) string {
	if len(s) > 2 && s[len(s)-2:] == ".0" {
		return s[:len(s)-2]
	}
	return s
}

// HumanDuration writes d to the precision that matters at its size: whole
// days and hours past a day (3d4h), hours and minutes past an hour, minutes
// and seconds past a minute, seconds to a tenth past a second (2.5s), and
// milliseconds or microseconds below.
func HumanDuration(d time.Duration) string {
	neg := ""
	if d < 0 {
		neg, d = "-", -d
	}
	var s string
	switch {
	case d >= 24*time.Hour:
		s = fmt.Sprintf("%dd", d/(24*time.Hour))
		if h := (d % (24 * time.Hour)) / time.Hour; h > 0 {
			s += fmt.Sprintf("%dh", h)
		}
	case d >= time.Hour:
		s = fmt.Sprintf("%dh", d/time.Hour)
		if m := (d % time.Hour) / time.Minute; m > 0 {
			s += fmt.Sprintf("%dm", m)
		}
	case d >= time.Minute:
		s = fmt.Sprintf("%dm", d/time.Minute)
		if sec := (d % time.Minute) / time.Second; sec > 0 {
			s += fmt.Sprintf("%ds", sec)
		}
	case d >= time.Second:
		s = trimZero(strconv.FormatFloat(d.Seconds(), 'f', 1, 64)) + "s"
	case d >= time.Millisecond:
		s = sig3(float64(d)/float64(time.Millisecond)) + "ms"
	case d > 0:
		s = sig3(float64(d)/float64(time.Microsecond)) + "µs"
	default:
		s = "0s"
	}
	return neg + s
}

// HumanSeconds is HumanDuration of s seconds; NaN (no data) is "–".
func HumanSeconds(s float64) string {
	if math.IsNaN(s) {
		return "–"
	}
	if math.IsInf(s, 1) {
		return "∞"
	}
	return HumanDuration(time.Duration(s * float64(time.Second)))
}

// HumanRate writes a rate per second to three significant digits (0 as
// "0/s", under 0.01 as "<0.01/s"); NaN (no data) is "–".
func HumanRate(r float64) string {
	switch {
	case math.IsNaN(r):
		return "–"
	case r == 0:
		return "0/s"
	case r < 0.01:
		return "<0.01/s"
	}
	return sig3(r) + "/s"
}

// HumanPercent writes a fraction (0.034) as a percentage to three
// significant digits (3.4%); NaN (no data) is "–".
func HumanPercent(f float64) string {
	switch {
	case math.IsNaN(f):
		return "–"
	case f == 0:
		return "0%"
	case f < 0.0001:
		return "<0.01%"
	}
	return sig3(f*100) + "%"
}

// sig3 writes v (> 0) to three significant digits, without a trailing
// ".0": 1234, 123, 12.3, 1.23, 0.123.
func sig3(v float64) string {
	switch {
	case v >= 100:
		return strconv.FormatFloat(math.Round(v), 'f', 0, 64)
	case v >= 10:
		return trimZero(strconv.FormatFloat(v, 'f', 1, 64))
	case v >= 1:
		return trimZeros(strconv.FormatFloat(v, 'f', 2, 64))
	}
	return trimZeros(strconv.FormatFloat(v, 'f', 3, 64))
}

func trimZeros(s string) string {
	for len(s) > 1 && s[len(s)-1] == '0' {
		s = s[:len(s)-1]
	}
	if s[len(s)-1] == '.' {
		s = s[:len(s)-1]
	}
	return s
}

// HumanCount writes a count to three significant digits past a thousand
// (12.3k, 4.56M), whole below.
func HumanCount(v float64) string {
	switch a := math.Abs(v); {
	case a >= 1e9:
		return sig3(v/1e9) + "G"
	case a >= 1e6:
		return sig3(v/1e6) + "M"
	case a >= 1e3:
		return sig3(v/1e3) + "k"
	}
	return strconv.FormatFloat(math.Round(v), 'f', 0, 64)
}

// bytesOf is HumanBytes of any integer a page holds.
func bytesOf(n any) string {
	switch v := n.(type) {
	case int:
		return HumanBytes(int64(v))
	case int64:
		return HumanBytes(v)
	case uint64:
		return HumanBytes(int64(min(v, math.MaxInt64)))
	case float64:
		return HumanBytes(int64(v))
	}
	return fmt.Sprint(n)
}

// UnitFuncs are the template functions of a page's units: bytes,
// duration, seconds, rate and percent.
var UnitFuncs = template.FuncMap{
	"bytes":    bytesOf,
	"duration": HumanDuration,
	"seconds":  HumanSeconds,
	"rate":     HumanRate,
	"percent":  HumanPercent,
	"count":    HumanCount,
}
