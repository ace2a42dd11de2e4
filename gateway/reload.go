package gateway

import (
	"reflect"
	"strings"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// RefuseReload counts a reload whose file could not be read or parsed.
func (s *Server) RefuseReload() { s.metrics.reloads.WithLabelValues("refused").Inc() }

// Reload applies a new config without dropping requests in flight or the
// pins of encoders that stay. Every key applies at once except those Config
// tags reload:"restart" (listeners, most limits, affinity, idempotency,
// shutdown): those keep their running values, and the log names each one
// the file changed. An invalid config changes nothing.
func (s *Server) Reload(next Config) error {
	if err := next.Validate(); err != nil {
		s.metrics.reloads.WithLabelValues("refused").Inc()
		return err
	}
	cur := s.conf()
	merged := next
	restart := keepRestartOnly(reflect.ValueOf(cur).Elem(), reflect.ValueOf(&merged).Elem(), "")
	// admin.token_file is read again even when its path is unchanged: a
	// rewritten file (a rotated Secret) is what the reload is for.
	if err := merged.Admin.ReadToken("admin"); err != nil {
		s.metrics.reloads.WithLabelValues("refused").Inc()
		return err
	}
	// Encoders and upstream apply at once, so a reload can ask for more
	// descriptors than the process may open: refuse it as New would.
	if _, err := Descriptors(merged, s.fds, true); err != nil {
		s.metrics.reloads.WithLabelValues("refused").Inc()
		return err
	}
	// The fleet reads bootstrap.token_file again, at the path the listener
	// started with (bootstrap is restart-only): it takes effect with the rest.
	ch, err := s.fleet.Apply(merged.fleetConfig(), func() { s.snap.Store(&merged) })
	if err != nil {
		s.metrics.reloads.WithLabelValues("refused").Inc()
		return err
	}
	if s.level != nil {
		if lvl, err := zapcore.ParseLevel(merged.Log.Level); err == nil {
			s.level.SetLevel(lvl)
		}
	}
	s.metrics.reloads.WithLabelValues("applied").Inc()
	s.log.Info("config reloaded", zap.Strings("encoders_added", ch.Added), zap.Strings("encoders_draining", ch.Draining),
		zap.Strings("encoders_removed", ch.Removed),
		zap.Int("encoders", len(merged.Encoders)), zap.Strings("unchanged_until_restart", restart))
	return nil
}

// keepRestartOnly sets every field of next tagged reload:"restart" that
// differs from cur back to cur's value, walking untagged structs, and
// returns those fields' YAML paths.
func keepRestartOnly(cur, next reflect.Value, path string) []string {
	var kept []string
	t := cur.Type()
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		at := name
		if path != "" {
			at = path + "." + name
		}
		switch {
		case f.Tag.Get("reload") == "restart":
			if !reflect.DeepEqual(cur.Field(i).Interface(), next.Field(i).Interface()) {
				next.Field(i).Set(cur.Field(i))
				kept = append(kept, at)
			}
		case f.Type.Kind() == reflect.Struct && f.Tag.Get("reload") == "":
			kept = append(kept, keepRestartOnly(cur.Field(i), next.Field(i), at)...)
		}
	}
	return kept
}
