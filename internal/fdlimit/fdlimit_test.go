package fdlimit

import (
	"errors"
	"runtime"
	"strings"
	"testing"
)

// fake is an RLIMIT_NOFILE that refuses soft limits above refuseAbove.
type fake struct {
	soft, hard  uint64
	refuseAbove uint64 // 0: refuse nothing
	sets        [][2]uint64
}

func (f *fake) Get() (uint64, uint64, error) { return f.soft, f.hard, nil }

func (f *fake) Set(soft, hard uint64) error {
	f.sets = append(f.sets, [2]uint64{soft, hard})
	if f.refuseAbove != 0 && soft > f.refuseAbove {
		return errors.New("operation not permitted")
	}
	f.soft, f.hard = soft, hard
	return nil
}

func TestEnsure(t *testing.T) {
	const inf = ^uint64(0)
	for _, tc := range []struct {
		name             string
		l                fake
		need             uint64
		wantSoft         uint64
		wantSets         int
		wantErr          string
		wantRaised       bool
		wantRaiseFailure bool
	}{
		{name: "fits: nothing changes", l: fake{soft: 1023, hard: 1024}, need: 1000, wantSoft: 1023},
		{name: "exactly the soft limit fits", l: fake{soft: 1023, hard: 1024}, need: 1023, wantSoft: 1023},
		{name: "raised to the hard limit", l: fake{soft: 256, hard: 4096}, need: 300, wantSoft: 4096, wantSets: 1, wantRaised: true},
		{name: "Go's hard-1 raised for a need of the hard limit", l: fake{soft: 4095, hard: 4096}, need: 4096, wantSoft: 4096, wantSets: 1, wantRaised: true},
		{name: "above the hard limit", l: fake{soft: 256, hard: 256}, need: 10343, wantSoft: 256, wantErr: "need 10343 descriptors; RLIMIT_NOFILE's hard limit is 256 (soft 256)"},
		{name: "unlimited hard: raised to the need", l: fake{soft: 256, hard: inf}, need: 5000, wantSoft: 5000, wantSets: 1, wantRaised: true},
		{name: "hard refused, need accepted", l: fake{soft: 256, hard: 1 << 20, refuseAbove: 10240}, need: 5000, wantSoft: 5000, wantSets: 2, wantRaised: true},
		{name: "raising refused", l: fake{soft: 256, hard: 1 << 20, refuseAbove: 300}, need: 5000, wantSoft: 256, wantSets: 2,
			wantErr: "raising it failed: operation not permitted", wantRaiseFailure: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := tc.l
			r, err := Ensure(tc.need, &l)
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("err %v, want %q", err, tc.wantErr)
			}
			var tooSmall *TooSmallError
			if err != nil && (!errors.As(err, &tooSmall) || tooSmall.Need != tc.need || (tooSmall.Err != nil) != tc.wantRaiseFailure) {
				t.Errorf("err %#v is not a *TooSmallError for need %d", err, tc.need)
			}
			if r.Soft != tc.wantSoft || l.soft != tc.wantSoft || r.Raised() != tc.wantRaised || r.Need != tc.need || r.Hard != tc.l.hard {
				t.Errorf("result %+v (limit now %d), want soft %d raised %v", r, l.soft, tc.wantSoft, tc.wantRaised)
			}
			if len(l.sets) != tc.wantSets {
				t.Errorf("Set calls %v, want %d", l.sets, tc.wantSets)
			}
			for _, s := range l.sets {
				if s[1] != tc.l.hard {
					t.Errorf("Set %v changed the hard limit %d", s, tc.l.hard)
				}
			}
		})
	}
}

func TestCheckChangesNothing(t *testing.T) {
	l := &fake{soft: 256, hard: 4096}
	if r, err := Check(300, l); err != nil || r.Soft != 256 || r.Raised() {
		t.Fatalf("Check(300): %+v %v", r, err)
	}
	if _, err := Check(5000, l); err == nil || !strings.Contains(err.Error(), "hard limit is 4096") {
		t.Fatalf("Check(5000): %v", err)
	}
	if len(l.sets) != 0 {
		t.Fatalf("Check set the limit: %v", l.sets)
	}
}

// The process's own limit reads back, and a need it already meets leaves
// it alone.
func TestProcess(t *testing.T) {
	soft, hard, err := Process.Get()
	if runtime.GOOS != "linux" && runtime.GOOS != "darwin" {
		if !errors.Is(err, ErrUnsupported) {
			t.Fatalf("Get on %s: %v", runtime.GOOS, err)
		}
		return
	}
	if err != nil || soft == 0 || soft > hard {
		t.Fatalf("Get: soft %d hard %d, %v", soft, hard, err)
	}
	if r, err := Ensure(soft, Process); err != nil || r.Raised() {
		t.Fatalf("Ensure(%d): %+v %v", soft, r, err)
	}
}
