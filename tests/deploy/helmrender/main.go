// helmrender renders a Helm chart the way `helm template` does, for machines
// without helm (Debian packages no helm; Go, sprig and the YAML library are
// packaged). It implements the part of Helm's engine that charts lean on:
// values.yaml merged with -f files, --set and --set-file; .Release, .Chart,
// .Values, .Files.Get; sprig's functions without env/expandenv (as Helm);
// Helm's include, tpl, required, fail, toYaml, fromYaml, toJson, fromJson;
// missingkey=zero with "<no value>" blanked (as Helm's non-strict mode).
// Not implemented (and unused by deploy/helm/plsh): lookup against a
// cluster, .Capabilities beyond a fixed KubeVersion, subcharts.
//
//	helmrender [-f values.yaml]... [--set a.b=v]... [--set-file a.b=path]...
//	           [--name RELEASE] [--namespace NS] CHART_DIR
//
// Prints every rendered manifest as "---\n# Source: CHART/templates/F\n...",
// NOTES.txt last; exits 1 with Helm's style of message on a template error.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	"github.com/ghodss/yaml"
)

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func die(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "helmrender: "+format+"\n", args...)
	os.Exit(1)
}

func readYAMLMap(path string) map[string]interface{} {
	data, err := os.ReadFile(path)
	if err != nil {
		die("%v", err)
	}
	out := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &out); err != nil {
		die("%s: %v", path, err)
	}
	return out
}

// mergeValues overlays src onto dst (maps merge key by key, anything else
// replaces), as Helm coalesces user values over the chart's.
func mergeValues(dst, src map[string]interface{}) {
	for k, v := range src {
		if sm, ok := v.(map[string]interface{}); ok {
			if dm, ok := dst[k].(map[string]interface{}); ok {
				mergeValues(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
}

// setPath assigns a --set style dotted path.
func setPath(values map[string]interface{}, path string, value interface{}) {
	parts := strings.Split(path, ".")
	m := values
	for _, p := range parts[:len(parts)-1] {
		next, ok := m[p].(map[string]interface{})
		if !ok {
			next = map[string]interface{}{}
			m[p] = next
		}
		m = next
	}
	m[parts[len(parts)-1]] = value
}

// parseSetValue types a --set value as Helm's strvals does: integers become
// int64, true/false booleans, null nil, anything else a string.
func parseSetValue(s string) interface{} {
	switch s {
	case "true":
		return true
	case "false":
		return false
	case "null":
		return nil
	}
	if i, err := strconv.ParseInt(s, 10, 64); err == nil {
		return i
	}
	return s
}

func toYAML(v interface{}) string {
	data, err := yaml.Marshal(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(data), "\n")
}

func fromYAML(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := yaml.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func toJSON(v interface{}) string {
	data, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(data)
}

func fromJSON(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

type files map[string][]byte

func (f files) Get(name string) string { return string(f[name]) }

func main() {
	var valueFiles, sets, setFiles multiFlag
	release, namespace := "plsh", "default"
	args := os.Args[1:]
	chartDir := ""
	for i := 0; i < len(args); i++ {
		need := func() string {
			if i+1 >= len(args) {
				die("%s needs a value", args[i])
			}
			i++
			return args[i]
		}
		switch args[i] {
		case "-f", "--values":
			valueFiles.Set(need())
		case "--set":
			sets.Set(need())
		case "--set-file":
			setFiles.Set(need())
		case "--name":
			release = need()
		case "--namespace", "-n":
			namespace = need()
		default:
			if strings.HasPrefix(args[i], "-") || chartDir != "" {
				die("unexpected argument %q", args[i])
			}
			chartDir = args[i]
		}
	}
	if chartDir == "" {
		die("usage: helmrender [-f FILE]... [--set K=V]... [--set-file K=PATH]... [--name R] [--namespace NS] CHART_DIR")
	}

	meta := readYAMLMap(filepath.Join(chartDir, "Chart.yaml"))
	chart := map[string]interface{}{}
	for k, v := range meta {
		// Helm exposes Chart.yaml's fields capitalised: .Chart.AppVersion.
		chart[strings.ToUpper(k[:1])+k[1:]] = v
	}
	chartName, _ := meta["name"].(string)

	values := readYAMLMap(filepath.Join(chartDir, "values.yaml"))
	for _, f := range valueFiles {
		mergeValues(values, readYAMLMap(f))
	}
	for _, s := range sets {
		kv := strings.SplitN(s, "=", 2)
		if len(kv) != 2 {
			die("--set %q: expected KEY=VALUE", s)
		}
		setPath(values, kv[0], parseSetValue(kv[1]))
	}
	for _, s := range setFiles {
		kv := strings.SplitN(s, "=", 2)
		if len(kv) != 2 {
			die("--set-file %q: expected KEY=PATH", s)
		}
		data, err := os.ReadFile(kv[1])
		if err != nil {
			die("--set-file %q: %v", s, err)
		}
		setPath(values, kv[0], string(data))
	}

	chartFiles := files{}
	var templateNames []string
	err := filepath.Walk(chartDir, func(path string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(chartDir, path)
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		chartFiles[rel] = data
		if strings.HasPrefix(rel, "templates/") {
			templateNames = append(templateNames, rel)
		}
		return nil
	})
	if err != nil {
		die("%v", err)
	}
	sort.Strings(templateNames)

	root := template.New("root")
	funcs := sprig.TxtFuncMap()
	delete(funcs, "env")
	delete(funcs, "expandenv")
	funcs["toYaml"] = toYAML
	funcs["fromYaml"] = fromYAML
	funcs["toJson"] = toJSON
	funcs["fromJson"] = fromJSON
	funcs["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil {
			return v, errors.New(msg)
		}
		if s, ok := v.(string); ok && s == "" {
			return v, errors.New(msg)
		}
		return v, nil
	}
	funcs["fail"] = func(msg string) (string, error) { return "", errors.New(msg) }
	funcs["lookup"] = func(string, string, string, string) (map[string]interface{}, error) {
		return map[string]interface{}{}, nil
	}
	funcs["include"] = func(name string, data interface{}) (string, error) {
		var buf bytes.Buffer
		if err := root.ExecuteTemplate(&buf, name, data); err != nil {
			return "", err
		}
		return buf.String(), nil
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		t, err := root.Clone()
		if err != nil {
			return "", err
		}
		t, err = t.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var buf bytes.Buffer
		if err := t.Execute(&buf, data); err != nil {
			return "", err
		}
		return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
	}
	root.Funcs(funcs).Option("missingkey=zero")
	for _, name := range templateNames {
		if _, err := root.New(chartName + "/" + name).Parse(string(chartFiles[name])); err != nil {
			die("parse error: %v", err)
		}
	}

	top := map[string]interface{}{
		"Values": values,
		"Chart":  chart,
		"Release": map[string]interface{}{
			"Name": release, "Namespace": namespace, "Service": "Helm",
			"IsInstall": true, "IsUpgrade": false, "Revision": 1,
		},
		"Capabilities": map[string]interface{}{
			"KubeVersion": map[string]interface{}{"Version": "v1.30.0", "Major": "1", "Minor": "30"},
		},
		"Files":    chartFiles,
		"Template": map[string]interface{}{"BasePath": chartName + "/templates"},
	}

	var out, notes bytes.Buffer
	for _, name := range templateNames {
		base := filepath.Base(name)
		if strings.HasPrefix(base, "_") {
			continue
		}
		full := chartName + "/" + name
		top["Template"].(map[string]interface{})["Name"] = full
		var buf bytes.Buffer
		if err := root.ExecuteTemplate(&buf, full, top); err != nil {
			die("execution error: %v", err)
		}
		text := strings.ReplaceAll(buf.String(), "<no value>", "")
		if strings.TrimSpace(text) == "" {
			continue
		}
		if base == "NOTES.txt" {
			notes.WriteString(text)
			continue
		}
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", full, strings.Trim(text, "\n"))
	}
	if notes.Len() > 0 {
		fmt.Fprintf(&out, "# NOTES:\n%s", "# "+strings.ReplaceAll(strings.TrimRight(notes.String(), "\n"), "\n", "\n# ")+"\n")
	}
	os.Stdout.Write(out.Bytes())
}
