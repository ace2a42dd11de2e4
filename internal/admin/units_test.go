package admin

import (
	"math"
	"testing"
	"time"
)

func TestHumanUnits(t *testing.T) {
	for _, c := range []struct{ got, want string }{
		{HumanBytes(268435456), "256 MiB"},
		{HumanBytes(1536), "1.5 KiB"},
		{HumanBytes(12), "12 B"},
		{HumanBytes(0), "0 B"},
		{HumanBytes(80 << 30), "80 GiB"},
		{HumanDuration(12 * time.Hour), "12h"},
		{HumanDuration(26*time.Hour + 5*time.Minute), "1d2h"},
		{HumanDuration(64 * time.Minute), "1h4m"},
		{HumanDuration(90 * time.Second), "1m30s"},
		{HumanDuration(2500 * time.Millisecond), "2.5s"},
		{HumanDuration(340 * time.Millisecond), "340ms"},
		{HumanDuration(1250 * time.Microsecond), "1.25ms"},
		{HumanDuration(12 * time.Microsecond), "12µs"},
		{HumanDuration(0), "0s"},
		{HumanSeconds(0.0123), "12.3ms"},
		{HumanSeconds(math.NaN()), "–"},
		{HumanRate(12.345), "12.3/s"},
		{HumanRate(1234.5), "1235/s"},
		{HumanRate(0.5), "0.5/s"},
		{HumanRate(0), "0/s"},
		{HumanRate(0.001), "<0.01/s"},
		{HumanRate(math.NaN()), "–"},
		{HumanPercent(0.034), "3.4%"},
		{HumanPercent(1), "100%"},
		{HumanPercent(0), "0%"},
	} {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
}
